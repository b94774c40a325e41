// hora dashboard: helpers shared by the jobs list and the job page.
//
// Everything shown comes from the coordinator's REST API and its server-sent
// events. Strings from the server (job ids, hosts, messages) only ever reach
// the page as text (textContent, attribute values), never as markup.
"use strict";

window.hora = (() => {
  const SVG_NS = "http://www.w3.org/2000/svg";
  // The pages live at "/" and "/jobs/ID": each says where the root is, so the
  // dashboard also works behind a proxy that serves it under a prefix.
  const ROOT = document.documentElement.dataset.root || "./";
  const FETCH_DEADLINE_MS = 10000;

  function append(node, children) {
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      if (Array.isArray(child)) append(node, child);
      else node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") node.textContent = String(value);
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    return node;
  }

  /** Replaces a node's children (null, undefined and false are left out; arrays flattened). */
  function fill(node, ...children) {
    node.replaceChildren();
    return append(node, children);
  }

  /** An HTML element: h("td", {class: "x"}, "text", child, ...). */
  function h(tag, attrs, ...children) {
    return append(setAttrs(document.createElement(tag), attrs), children);
  }

  /** An SVG element, as h() makes HTML ones. */
  function s(tag, attrs, ...children) {
    return append(setAttrs(document.createElementNS(SVG_NS, tag), attrs), children);
  }

  function url(path) {
    return new URL(ROOT + path, location.href).toString();
  }

  class HttpError extends Error {
    constructor(status, text) {
      super(`HTTP ${status}: ${text}`);
      this.status = status;
    }
  }

  /** GET a JSON document of the API, with a deadline. */
  async function getJSON(path) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), FETCH_DEADLINE_MS);
    try {
      const answer = await fetch(url(path), {
        signal: abort.signal, credentials: "same-origin", headers: {Accept: "application/json"},
      });
      if (!answer.ok) {
        let detail = answer.statusText;
        try { detail = (await answer.json()).detail || detail; } catch (_) { /* not JSON */ }
        throw new HttpError(answer.status, detail);
      }
      return await answer.json();
    } catch (err) {
      if (err.name === "AbortError") throw new HttpError(0, `no answer within ${FETCH_DEADLINE_MS / 1000} s`);
      throw err;
    } finally {
      clearTimeout(timer);
    }
  }

  /** The `?token=` of a printed URL has set the cookie by now: drop it from the address bar. */
  function dropTokenFromAddress() {
    const here = new URL(location.href);
    if (!here.searchParams.has("token")) return;
    here.searchParams.delete("token");
    history.replaceState(null, "", here.pathname + here.search + here.hash);
  }

  /**
   * A server-sent event stream that says how it is doing.
   * onState("live" | "reconnecting" | "closed"); the browser reconnects by
   * itself after a network error; a refusal (404, 401) closes the stream and
   * onClosed decides what next.
   */
  function stream(path, event, {onMessage, onState, onClosed}) {
    const source = new EventSource(url(path), {withCredentials: true});
    source.addEventListener(event, (ev) => onMessage(JSON.parse(ev.data)));
    source.addEventListener("open", () => onState("live"));
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) {
        onState("closed");
        onClosed();
      } else {
        onState("reconnecting");
      }
    });
    return source;
  }

  function setLive(state, text) {
    const node = document.getElementById("live");
    if (!node) return;
    node.dataset.live = state;
    node.textContent = text || state;
  }

  // ---- formatting ---------------------------------------------------------

  function duration(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    if (seconds < 1) return `${(seconds * 1000).toFixed(0)} ms`;
    if (seconds < 10) return `${seconds.toFixed(1)} s`;
    if (seconds < 60) return `${Math.floor(seconds)} s`;
    const m = Math.floor(seconds / 60);
    if (m < 60) return `${m} min ${Math.floor(seconds % 60)} s`;
    const hours = Math.floor(m / 60);
    if (hours < 48) return `${hours} h ${m % 60} min`;
    return `${Math.floor(hours / 24)} d ${hours % 24} h`;
  }

  function number(value, digits = 1) {
    if (value === null || value === undefined || !isFinite(value)) return "–";
    if (Math.abs(value) >= 1e6) return `${(value / 1e6).toFixed(digits)} M`;
    if (Math.abs(value) >= 1e4) return `${(value / 1e3).toFixed(digits)} k`;
    if (Number.isInteger(value)) return String(value);
    return value.toFixed(digits);
  }

  function ms(value) {
    if (value === null || value === undefined || !isFinite(value)) return "–";
    return value >= 100 ? `${value.toFixed(0)} ms` : `${value.toFixed(1)} ms`;
  }

  function percent(ratio) {
    if (ratio === null || ratio === undefined || !isFinite(ratio)) return "–";
    return `${(ratio * 100).toFixed(ratio >= 0.999 || ratio === 0 ? 0 : 1)} %`;
  }

  function clock(unixMs, withMs = false) {
    const d = new Date(unixMs);
    const pad = (n, w = 2) => String(n).padStart(w, "0");
    const base = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
    return withMs ? `${base}.${pad(d.getMilliseconds(), 3)}` : base;
  }

  function badge(kind, text, extra) {
    return h("span", {class: `badge badge-${kind}${extra ? " " + extra : ""}`}, text);
  }

  // ---- charts -------------------------------------------------------------

  function niceStep(span, ticks) {
    const raw = span / Math.max(1, ticks);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * mag) return m * mag;
    return 10 * mag;
  }

  /**
   * A time series chart as inline SVG.
   *
   * lines: [{name, cls, points: [[unixMs, value|null], ...], step}]
   * marks: [{t: unixMs, label, cls}] (vertical lines, e.g. generations)
   * hlines: [{value, label, cls}] (horizontal guides, e.g. min/max size)
   */
  function timeChart({lines, marks = [], hlines = [], yFormat = number, yMin = 0, yMaxAtLeast = 1,
    xEnd = null, width = 640, height = 180, integer = false, gapMs = 3500}) {
    const pad = {l: 46, r: 14, t: 16, b: 24};
    const xs = [];
    let yMax = yMaxAtLeast;
    for (const line of lines) {
      for (const [t, v] of line.points) {
        xs.push(t);
        if (v !== null && v !== undefined && isFinite(v)) yMax = Math.max(yMax, v);
      }
    }
    for (const mark of marks) xs.push(mark.t);
    for (const g of hlines) yMax = Math.max(yMax, g.value);
    if (xEnd !== null) xs.push(xEnd);
    let x0 = Math.min(...xs);
    let x1 = Math.max(...xs);
    if (!isFinite(x0)) { x0 = Date.now() - 60000; x1 = Date.now(); }
    if (x1 - x0 < 30000) x0 = x1 - 30000;
    const yStep = integer ? Math.max(1, Math.ceil(niceStep(yMax - yMin, 4))) : niceStep(yMax - yMin, 4);
    yMax = Math.max(yStep, Math.ceil((yMax * 1.08) / yStep) * yStep);
    const W = width - pad.l - pad.r;
    const H = height - pad.t - pad.b;
    const X = (t) => pad.l + ((t - x0) / (x1 - x0)) * W;
    const Y = (v) => pad.t + H - ((v - yMin) / (yMax - yMin)) * H;
    const root = s("svg", {viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img",
      preserveAspectRatio: "xMidYMid meet"});
    const grid = s("g", {class: "grid"});
    for (let v = yMin; v <= yMax + 1e-9; v += yStep) {
      grid.append(s("line", {x1: pad.l, x2: pad.l + W, y1: Y(v), y2: Y(v)}),
        s("text", {x: pad.l - 6, y: Y(v) + 4, class: "tick y"}, yFormat(v)));
    }
    const tStep = niceStep(x1 - x0, 4);
    for (let t = Math.ceil(x0 / tStep) * tStep; t <= x1; t += tStep) {
      grid.append(s("line", {x1: X(t), x2: X(t), y1: pad.t, y2: pad.t + H, class: "vgrid"}),
        s("text", {x: X(t), y: height - 6, class: "tick x"}, clock(t)));
    }
    root.append(grid);
    for (const guide of hlines) {
      root.append(s("g", {class: `guide ${guide.cls || ""}`},
        s("line", {x1: pad.l, x2: pad.l + W, y1: Y(guide.value), y2: Y(guide.value)}),
        s("text", {x: pad.l + W - 2, y: Y(guide.value) - 3, class: "guide-label"}, guide.label)));
    }
    for (const mark of marks) {
      const x = X(mark.t);
      root.append(s("g", {class: `mark ${mark.cls || ""}`, "data-generation": mark.generation},
        s("line", {x1: x, x2: x, y1: pad.t - 2, y2: pad.t + H}),
        s("text", {x: x + 3, y: pad.t + 8, class: "mark-label"}, mark.label)));
    }
    let total = 0;
    for (const line of lines) {
      let d = "";
      let prev = null;
      let count = 0;
      for (const [t, v] of line.points) {
        if (v === null || v === undefined || !isFinite(v)) { prev = null; continue; }
        const x = X(t).toFixed(1);
        const y = Y(v).toFixed(1);
        if (prev === null || t - prev.t > gapMs) d += `M${x},${y}`;
        else if (line.step) d += `H${x}V${y}`;
        else d += `L${x},${y}`;
        prev = {t, v};
        count += 1;
      }
      total += count;
      root.append(s("path", {d: d || "M0,0", class: `line ${line.cls || ""}`, "data-points": count}));
      if (prev !== null) {
        root.append(s("circle", {cx: X(prev.t), cy: Y(prev.v), r: 3, class: `dot ${line.cls || ""}`}));
      }
    }
    root.setAttribute("data-points", total);
    return root;
  }

  function legend(items) {
    return h("div", {class: "chart-legend"},
      items.map(([cls, text]) => h("span", {class: `swatch ${cls}`}, text)));
  }

  return {
    h, s, fill, url, getJSON, HttpError, stream, setLive, dropTokenFromAddress,
    duration, number, ms, percent, clock, badge, timeChart, legend,
  };
})();
