// hora dashboard: the jobs list (GET /api/v1/jobs, then the stream GET /api/v1/live).
"use strict";

(() => {
  const {h, fill, getJSON, stream, setLive, dropTokenFromAddress, duration, number, badge, clock} = window.hora;
  const body = document.getElementById("jobs-body");
  const count = document.getElementById("jobs-count");

  function sizeCell(job) {
    const bounds = job.elastic
      ? ` / ${job.min_size} / ${job.max_size > 0 ? job.max_size : "∞"}` : "";
    return h("td", {class: "num", title: job.elastic ? "size / min / max" : "size"},
      `${job.size}${bounds}`);
  }

  function lastEventCell(job) {
    const e = job.last_event;
    if (!e) return h("td", {class: "muted"}, "–");
    // The coordinator's clock, not the browser's: created_at + age_s is its "now".
    const ago = job.created_at + job.age_s - e.unix_ms / 1000;
    return h("td", {class: "last-event", title: clock(e.unix_ms, true)},
      badge(`event event-${e.kind}`, e.kind), " ",
      h("span", {class: "event-text"}, e.message || (e.host ? `host ${e.host}` : "")),
      h("span", {class: "muted ago"}, ` ${duration(Math.max(0, ago))} ago`));
  }

  function row(job) {
    const link = h("a", {href: `jobs/${encodeURIComponent(job.job_id)}`, class: "job-link"}, job.job_id);
    return h("tr", {"data-job": job.job_id, "data-state": job.state},
      h("td", {}, link, job.history_restarted ? h("span", {class: "muted small"}, " (rebuilt)") : null),
      h("td", {}, badge(`job-${job.state}`, job.state),
        job.failure ? h("div", {class: "failure small"}, job.failure) : null),
      sizeCell(job),
      h("td", {class: "num"}, job.generation, job.reset_count
        ? h("span", {class: "muted small"}, ` (${job.reset_count} reset${job.reset_count > 1 ? "s" : ""})`) : null),
      h("td", {class: "num"}, duration(job.age_s)),
      h("td", {class: "num"}, job.steps_per_s > 0 ? number(job.steps_per_s, 1) : "–"),
      lastEventCell(job));
  }

  function render(jobs) {
    count.textContent = `${jobs.length} job${jobs.length === 1 ? "" : "s"}`;
    if (!jobs.length) {
      fill(body, h("p", {class: "empty"},
        "No jobs yet. Start one with horarun (it prints this page's address), or point workers at this coordinator."));
      return;
    }
    const newest = [...jobs].reverse();
    fill(body, h("table", {class: "table jobs"},
      h("thead", {}, h("tr", {},
        [["job"], ["state"], ["world size / min / max", "num"], ["generation", "num"], ["age", "num"],
          ["steps/s", "num"], ["last event"]].map(([name, cls]) => h("th", {class: cls}, name)))),
      h("tbody", {}, newest.map(row))));
  }

  async function start() {
    try {
      render(await getJSON("api/v1/jobs"));
    } catch (err) {
      fill(body, h("p", {class: "error"}, `Cannot read the jobs: ${err.message}`));
      setLive("closed", "offline");
      setTimeout(start, 3000);
      return;
    }
    stream("api/v1/live", "jobs", {
      onMessage: render,
      onState: (state) => setLive(state, state === "live" ? "live" : state),
      onClosed: () => setTimeout(start, 3000),
    });
  }

  dropTokenFromAddress();
  start();
})();
