// hora dashboard: one job's page.
//
// The first paint reads the REST API (the job, its telemetry, its events);
// then one server-sent event stream (GET /api/v1/jobs/{id}/live) carries every
// change. Its first message, marked "reset", holds everything kept and
// replaces what the page has (also after a reconnect); later messages carry
// the job and its telemetry as they are now plus only the new events and
// series points, which the page appends.
"use strict";

(() => {
  const H = window.hora;
  const {h, fill, badge, duration, number, ms, percent, clock} = H;

  const jobId = decodeURIComponent(location.pathname.slice(location.pathname.lastIndexOf("/") + 1));
  const path = `api/v1/jobs/${encodeURIComponent(jobId)}`;
  const MAX_EVENTS = 5000; // the coordinator keeps at most --max-events-per-job anyway
  const MAX_POINTS = 900; // 15 min at one sample a second, as the coordinator keeps
  const SHOWN_EVENTS = 500;

  const state = {
    job: null, // JobDetail
    tel: null, // TelemetryView (its series and generations are kept below, accumulated)
    events: [], // oldest first
    eventsVersion: 0, // goes up whenever events change
    series: [],
    marks: [],
    lastSeen: new Map(), // host + pid -> the last RankView of that process
    source: null,
  };

  const $ = (id) => document.getElementById(id);
  document.title = `hora · ${jobId}`;
  $("crumb-job").textContent = jobId;

  // ---- state ---------------------------------------------------------------

  const procKey = (host, pid) => `${host}\u0000${pid}`;

  function remember(ranks) {
    for (const r of ranks) if (r.pid > 0) state.lastSeen.set(procKey(r.host, r.pid), r);
    if (state.lastSeen.size > 4096) state.lastSeen.clear();
  }

  function replaceAll(job, tel, events) {
    state.job = job;
    state.tel = tel;
    state.series = tel.series.slice(-MAX_POINTS);
    state.marks = tel.generations.slice();
    state.events = events.slice(-MAX_EVENTS);
    state.eventsVersion += 1;
    remember(tel.ranks);
  }

  function appendNew(message) {
    state.job = message.job;
    state.tel = message.telemetry;
    const lastT = state.series.length ? state.series[state.series.length - 1].unix_ms : -1;
    for (const p of message.telemetry.series) if (p.unix_ms > lastT) state.series.push(p);
    const lastM = state.marks.length ? state.marks[state.marks.length - 1].unix_ms : -1;
    for (const m of message.telemetry.generations) if (m.unix_ms > lastM) state.marks.push(m);
    if (message.events.length) {
      state.events.push(...message.events);
      state.eventsVersion += 1;
    }
    if (state.series.length > MAX_POINTS) state.series.splice(0, state.series.length - MAX_POINTS);
    if (state.events.length > MAX_EVENTS) state.events.splice(0, state.events.length - MAX_EVENTS);
    remember(message.telemetry.ranks);
  }

  function apply(message) {
    if (message.reset) replaceAll(message.job, message.telemetry, message.events);
    else appendNew(message);
    render();
  }

  // ---- header --------------------------------------------------------------

  function stat(label, value, attrs) {
    return h("div", {class: "stat", ...attrs}, h("span", {class: "stat-label"}, label),
      h("span", {class: "stat-value"}, value));
  }

  function renderHeader() {
    const job = state.job;
    const tel = state.tel;
    const bounds = job.elastic ? `${job.min_size} – ${job.max_size > 0 ? job.max_size : "∞"}` : "fixed";
    fill($("job-head"),
      h("div", {class: "job-title"},
        h("h1", {id: "job-id"}, job.job_id),
        badge(`job-${job.state}`, job.state, "big"),
        job.elastic ? badge("plain", "elastic") : null),
      h("div", {class: "stats"},
        stat("generation", String(job.generation), {id: "job-generation", "data-generation": job.generation}),
        stat("resets", String(job.reset_count), {id: "job-resets"}),
        stat("world size", String(job.size), {id: "job-size"}),
        stat("min – max", bounds),
        stat("age", duration(job.age_s)),
        stat("steps/s", job.steps_per_s > 0 ? number(job.steps_per_s, 1) : "–"),
        stat("ranks reporting", `${tel.ranks.filter((r) => r.reported).length} / ${tel.ranks.length}`)));
    const notes = [];
    if (job.failure) notes.push(h("p", {class: "failure"}, `Failed: ${job.failure}`));
    if (job.history_restarted) {
      notes.push(h("p", {}, "The coordinator restarted without a journal and rebuilt this job from its members' reports: the event log starts at the restart."));
    }
    if (job.events_dropped > 0) {
      notes.push(h("p", {}, `${job.events_dropped} oldest event(s) were dropped from the log (--max-events-per-job).`));
    }
    const banner = $("banner");
    fill(banner, ...notes);
    banner.hidden = notes.length === 0;
  }

  // ---- rank map ------------------------------------------------------------

  function field(label, value, cls) {
    return h("div", {class: `field ${cls || ""}`}, h("span", {class: "field-label"}, label),
      h("span", {class: "field-value"}, value));
  }

  function rankCard(r) {
    const classes = ["rank-card", `state-${r.state}`];
    if (r.heartbeat_late) classes.push("late");
    if (r.straggler) classes.push("straggler");
    const tags = [badge(`member-${r.state}`, r.state)];
    if (r.heartbeat_late) tags.push(badge("late", "heartbeat late"));
    if (r.straggler) tags.push(badge("straggler", "straggler"));
    return h("article", {
      class: classes.join(" "), "data-rank": r.rank, "data-state": r.state, "data-host": r.host,
      "data-pid": r.pid, "data-late": r.heartbeat_late ? "true" : "false",
      "data-straggler": r.straggler ? "true" : "false",
    },
    h("header", {}, h("span", {class: "rank-no"}, r.rank >= 0 ? `rank ${r.rank}` : "joining"), tags),
    h("div", {class: "fields"},
      field("host", r.host, "host"),
      field("local rank", r.local_rank >= 0 ? String(r.local_rank) : "–"),
      field("pid", String(r.pid), "pid"),
      field("heartbeat", `${duration(r.heartbeat_age_s)} ago`, r.heartbeat_late ? "warn" : ""),
      field("steps done", r.reported ? number(r.steps, 0) : "–", "steps"),
      field("last step", r.reported && r.steps > 0 ? duration(r.last_step_s) : "–"),
      field("steps/s", r.reported ? number(r.steps_per_s, 1) : "–"),
      r.samples_per_s !== null ? field("samples/s", number(r.samples_per_s, 0)) : null),
    r.cause ? h("p", {class: "cause"}, r.cause) : null);
  }

  // Members of the generation before this one that were lost or left: the
  // coordinator's member list holds only the current generation, its event
  // log holds who went and why. Their cards say so, with the last figures
  // this page saw for that process.
  function departedCards() {
    const job = state.job;
    const current = new Set(state.tel.ranks.map((r) => procKey(r.host, r.pid)));
    const gone = new Map();
    for (const e of state.events) {
      if ((e.kind !== "lost" && e.kind !== "left") || e.pid <= 0) continue;
      if (e.generation < job.generation - 1) continue;
      const key = procKey(e.host, e.pid);
      if (!current.has(key)) gone.set(key, e);
    }
    return [...gone.values()].sort((a, b) => a.rank - b.rank).map((e) => {
      const seen = state.lastSeen.get(procKey(e.host, e.pid));
      const ago = (state.tel.unix_ms - e.unix_ms) / 1000;
      return h("article", {
        class: `rank-card departed state-${e.kind}`, "data-rank": e.rank, "data-state": e.kind,
        "data-host": e.host, "data-pid": e.pid, "data-departed": "true", "data-generation": e.generation,
      },
      h("header", {}, h("span", {class: "rank-no"}, `rank ${e.rank}`),
        badge(`member-${e.kind}`, e.kind), badge("plain", `generation ${e.generation}`)),
      h("div", {class: "fields"},
        field("host", e.host, "host"),
        field("local rank", seen && seen.local_rank >= 0 ? String(seen.local_rank) : "–"),
        field("pid", String(e.pid), "pid"),
        field(e.kind, `${duration(Math.max(0, ago))} ago`),
        field("steps done", seen && seen.reported ? number(seen.steps, 0) : "–", "steps"),
        field("last step", seen && seen.reported && seen.steps > 0 ? duration(seen.last_step_s) : "–")),
      h("p", {class: "cause"}, e.message || e.kind));
    });
  }

  function renderRanks() {
    const cards = state.tel.ranks.map(rankCard);
    const gone = departedCards();
    const body = $("ranks-body");
    if (!cards.length && !gone.length) {
      fill(body, h("p", {class: "empty"}, "No members yet: the job waits for its workers to join."));
      return;
    }
    fill(body,
      h("div", {class: "rank-grid", id: "rank-grid"}, cards),
      gone.length ? h("h3", {class: "sub"}, `Gone since generation ${state.job.generation - 1}`) : null,
      gone.length ? h("div", {class: "rank-grid", id: "departed-grid"}, gone) : null);
  }

  // ---- charts --------------------------------------------------------------

  function markLines() {
    return state.marks.map((m) => ({
      t: m.unix_ms, generation: m.generation, label: `g${m.generation}${m.reset ? " reset" : ""}`,
      cls: m.reset ? "reset" : "gen",
    }));
  }

  function renderWorld() {
    const job = state.job;
    const resets = state.marks.filter((m) => m.reset).length;
    $("world-note").textContent =
      `generation ${job.generation} · ${job.reset_count} reset${job.reset_count === 1 ? "" : "s"}`
      + (resets !== job.reset_count ? ` (${resets} in view)` : "");
    const body = $("world-body");
    if (!state.series.length && !state.marks.length) {
      fill(body, h("p", {class: "empty"}, "No samples yet: the coordinator samples a job once a second while it runs."));
      return;
    }
    const hlines = [];
    if (job.elastic) {
      hlines.push({value: job.min_size, label: `min ${job.min_size}`, cls: "min"});
      if (job.max_size > 0) hlines.push({value: job.max_size, label: `max ${job.max_size}`, cls: "max"});
    }
    const points = state.series.map((p) => [p.unix_ms, p.size]);
    // The sizes the generations formed with: the steps of the line between samples.
    for (const m of state.marks) points.push([m.unix_ms, m.size]);
    points.sort((a, b) => a[0] - b[0]);
    fill(body,
      H.timeChart({lines: [{name: "size", cls: "size", points, step: true}], marks: markLines(), hlines,
        integer: true, yFormat: (v) => String(Math.round(v)), xEnd: state.tel.unix_ms, gapMs: 1e12}),
      H.legend([["size", "world size"], ["gen", "generation formed"], ["reset", "reset (new generation after a change)"]]));
  }

  function renderThroughput() {
    const body = $("throughput-body");
    const pts = state.series;
    const last = pts.length ? pts[pts.length - 1] : null;
    $("throughput-note").textContent = last
      ? `${number(last.steps_per_s, 1)} steps/s` + (last.samples_per_s !== null ? ` · ${number(last.samples_per_s, 0)} samples/s` : "")
      : "";
    if (!pts.some((p) => p.steps_per_s > 0 || p.steps > 0)) {
      fill(body, h("p", {class: "empty"}, "No steps reported yet."));
      return;
    }
    const charts = [
      h("h3", {class: "sub"}, "steps per second"),
      H.timeChart({lines: [{name: "steps/s", cls: "steps", points: pts.map((p) => [p.unix_ms, p.steps_per_s])}],
        marks: markLines(), height: 150, xEnd: state.tel.unix_ms}),
    ];
    if (pts.some((p) => p.samples_per_s !== null)) {
      charts.push(h("h3", {class: "sub"}, "samples per second"),
        H.timeChart({lines: [{name: "samples/s", cls: "samples", points: pts.map((p) => [p.unix_ms, p.samples_per_s])}],
          marks: markLines(), height: 150, xEnd: state.tel.unix_ms}));
    } else {
      charts.push(h("p", {class: "muted small"}, "samples/s shows once the script calls hvd.set_batch_size(n)."));
    }
    fill(body, ...charts);
  }

  // ---- negotiation ---------------------------------------------------------

  function renderNegotiation() {
    const n = state.tel.negotiation;
    const steady = n.messages_per_step === 0;
    $("negotiation-note").textContent = n.messages_per_step === null ? "no steps yet"
      : steady ? "steady state: the coordinator is off the hot path" : "the coordinator takes part in the steps";
    const pts = state.series.map((p) => [p.unix_ms, p.messages_per_step]);
    fill($("negotiation-body"),
      h("div", {class: "tiles"},
        h("div", {class: "tile", "data-stat": "negotiated"}, h("span", {class: "tile-value"}, number(n.negotiated_tensors, 0)), h("span", {class: "tile-label"}, "tensors negotiated")),
        h("div", {class: "tile", "data-stat": "messages"}, h("span", {class: "tile-value"}, number(n.negotiation_messages, 0)), h("span", {class: "tile-label"}, "coordinator messages")),
        h("div", {class: "tile", "data-stat": "hit-ratio"}, h("span", {class: "tile-value"}, percent(n.cache_hit_ratio)), h("span", {class: "tile-label"}, `cache hit ratio (${number(n.cache_hits, 0)} hits, ${number(n.cache_misses, 0)} misses)`)),
        h("div", {class: `tile ${steady ? "good" : n.messages_per_step === null ? "" : "warn"}`, "data-stat": "messages-per-step"},
          h("span", {class: "tile-value"}, n.messages_per_step === null ? "–" : number(n.messages_per_step, 2)),
          h("span", {class: "tile-label"}, "messages per step (last 10 s)"))),
      pts.some((p) => p[1] !== null) ? h("h3", {class: "sub"}, "coordinator messages per step") : null,
      pts.some((p) => p[1] !== null)
        ? H.timeChart({lines: [{name: "messages/step", cls: "messages", points: pts}], marks: markLines(),
          height: 120, yFormat: (v) => number(v, 1), xEnd: state.tel.unix_ms})
        : null);
  }

  // ---- stragglers ----------------------------------------------------------

  function renderStragglers() {
    const st = state.tel.stragglers;
    const rows = state.tel.ranks.filter((r) => r.state === "active" && r.reported && r.rounds > 0);
    const body = $("stragglers-body");
    if (st.slowest_rank === null || !rows.length) {
      fill(body, h("p", {class: "empty"}, "No agreement rounds reported yet."));
      return;
    }
    const verdict = st.is_straggler
      ? `rank ${st.slowest_rank} (${st.host}) is a straggler`
      : `rank ${st.slowest_rank} (${st.host}) arrives last most often, within chance`;
    const maxP95 = Math.max(1, ...rows.map((r) => r.lateness_p95_ms));
    fill(body,
      h("p", {class: `headline ${st.is_straggler ? "straggling" : ""}`, id: "slowest",
        "data-slowest-rank": st.slowest_rank, "data-straggler": st.is_straggler ? "true" : "false"},
      h("strong", {}, verdict), ": last at ", percent(st.last_share), " of ", number(st.rounds, 0),
      " rounds, ", ms(st.lateness_p50_ms), " late at the median, ", ms(st.lateness_p95_ms), " at p95."),
      h("table", {class: "table stragglers"},
        h("thead", {}, h("tr", {}, [["rank", "num"], ["host"], ["p50 late", "num"], ["p95 late", "num"], [""],
          ["last at", "num"], ["rounds", "num"]].map(([t, cls]) => h("th", {class: cls}, t)))),
        h("tbody", {}, rows.sort((a, b) => a.rank - b.rank).map((r) => {
          const bar = h("span", {class: "bar-fill"});
          bar.style.width = `${Math.max(1, (r.lateness_p95_ms / maxP95) * 100).toFixed(1)}%`;
          return h("tr", {"data-rank": r.rank, class: r.rank === st.slowest_rank ? "slowest" : "",
            "data-straggler": r.straggler ? "true" : "false"},
          h("td", {class: "num"}, String(r.rank)), h("td", {}, r.host),
          h("td", {class: "num"}, ms(r.lateness_p50_ms)), h("td", {class: "num"}, ms(r.lateness_p95_ms)),
          h("td", {class: "bar-cell"}, h("span", {class: `bar ${r.straggler ? "straggler" : ""}`}, bar)),
          h("td", {class: "num"}, percent(r.last_share)), h("td", {class: "num"}, number(r.rounds, 0)));
        }))));
  }

  // ---- event log -----------------------------------------------------------

  const kindSelect = $("event-kind");
  const textFilter = $("event-text");
  kindSelect.addEventListener("change", () => renderEvents());
  textFilter.addEventListener("input", () => renderEvents());

  function syncKinds() {
    const kinds = [...new Set(state.events.map((e) => e.kind))].sort();
    const have = [...kindSelect.options].slice(1).map((o) => o.value);
    if (kinds.join("\u0000") === have.join("\u0000")) return;
    const chosen = kindSelect.value;
    fill(kindSelect, h("option", {value: ""}, "all"),
      ...kinds.map((k) => h("option", {value: k}, k)));
    kindSelect.value = kinds.includes(chosen) ? chosen : "";
  }

  let shownEvents = ""; // what the log shows now: redrawn only when that changes

  function renderEvents() {
    syncKinds();
    const kind = kindSelect.value;
    const text = textFilter.value.trim().toLowerCase();
    const key = `${state.eventsVersion}|${kind}|${text}`;
    if (key === shownEvents) return; // keeps a text selection in the log across updates
    shownEvents = key;
    const body = $("events-body");
    if (!state.events.length) {
      fill(body, h("p", {class: "empty"}, "No events yet."));
      return;
    }
    const matching = [];
    for (let i = state.events.length - 1; i >= 0 && matching.length < SHOWN_EVENTS; i -= 1) {
      const e = state.events[i];
      if (kind && e.kind !== kind) continue;
      if (text && !`${e.kind} ${e.message} ${e.host} ${e.pid} rank ${e.rank} generation ${e.generation}`
        .toLowerCase().includes(text)) continue;
      matching.push(e);
    }
    const rows = matching.map((e) => h("tr", {class: `event event-${e.kind}`, "data-kind": e.kind},
      h("td", {class: "time"}, clock(e.unix_ms, true)),
      h("td", {}, badge(`event event-${e.kind}`, e.kind)),
      h("td", {class: "num"}, String(e.generation)),
      h("td", {class: "who"}, e.rank >= 0 ? `rank ${e.rank}` : "", e.host ? ` ${e.host}` : "", e.pid > 0 ? ` pid ${e.pid}` : ""),
      h("td", {class: "message"}, e.message)));
    fill(body,
      matching.length ? h("table", {class: "table events", id: "event-table"},
        h("thead", {}, h("tr", {}, [["time"], ["kind"], ["gen", "num"], ["who"], ["what"]]
          .map(([t, cls]) => h("th", {class: cls}, t)))),
        h("tbody", {}, rows)) : h("p", {class: "empty"}, "No event matches the filter."),
      h("p", {class: "muted small"}, `${matching.length < SHOWN_EVENTS ? matching.length : `the newest ${SHOWN_EVENTS}`} of ${state.events.length} events, newest first`));
  }

  // ---- the loop ------------------------------------------------------------

  function render() {
    renderHeader();
    renderRanks();
    renderWorld();
    renderThroughput();
    renderNegotiation();
    renderStragglers();
    renderEvents();
    document.body.dataset.generation = String(state.job.generation);
  }

  function showMissing(err) {
    const missing = err.status === 404;
    fill($("job-head"), h("div", {class: "job-title"}, h("h1", {id: "job-id"}, jobId),
      badge(missing ? "plain" : "job-failed", missing ? "not here (yet)" : "unreachable", "big")),
    h("p", {class: missing ? "muted" : "error"}, missing
      ? "The coordinator has no such job (yet). This page shows it once its first worker joins."
      : `Cannot read the job: ${err.message}`));
    H.setLive("closed", missing ? "waiting for the job" : "offline");
  }

  async function start() {
    if (state.source) { state.source.close(); state.source = null; }
    try {
      const [job, tel, events] = await Promise.all([
        H.getJSON(path), H.getJSON(`${path}/telemetry`), H.getJSON(`${path}/events`)]);
      replaceAll(job, tel, events);
      render();
    } catch (err) {
      if (state.job === null) showMissing(err);
      else H.setLive("closed", err.status === 404 ? "job gone" : "offline");
      setTimeout(start, err.status === 404 ? 1000 : 3000);
      return;
    }
    state.source = H.stream(`${path}/live`, "job", {
      onMessage: apply,
      onState: (s) => H.setLive(s, s),
      onClosed: () => setTimeout(start, 2000),
    });
  }

  H.dropTokenFromAddress();
  start();
})();
