// The web dashboard: the controller's status snapshots (what `status --watch --json` prints), pushed over
// server-sent events, drawn into the page and three uPlot charts. No framework and no build step: each snapshot
// changes only the cells whose text changed, so the page does not flicker and a watcher of the DOM sees changes.
"use strict";

(() => {
  const HISTORY_S = 300;      // the charts show the last five minutes
  const SAMPLE_GAP_S = 0.5;   // one chart point per half second at most: snapshots come up to ten a second
  const PALETTE = ["#58a6ff", "#3fb950", "#d29922", "#f778ba", "#a371f7", "#39c5cf", "#ff7b72", "#e3b341"];
  const byId = (id) => document.getElementById(id);

  const history = { time: [], decode: [], queue: [], busy: [], compute: {} };  // compute: node name -> ms
  const charts = {};
  let latest = null;
  let planKey = null;
  let eventsKey = null;

  // --- formatting, as the terminal dashboard formats -------------------------------------------------

  function setText(element, text) {
    if (element.textContent !== text) element.textContent = text;
  }

  function compact(bytes) {
    const units = ["B", "K", "M", "G", "T"];
    let value = bytes;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    return `${value >= 10 || unit === 0 ? value.toFixed(0) : value.toFixed(1)}${units[unit]}`;
  }

  function number(value, digits, suffix = "") {
    return value === null || value === undefined ? "-" : `${value.toFixed(digits)}${suffix}`;
  }

  function duration(seconds) {
    const s = Math.max(0, Math.floor(seconds));
    if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor(s / 60) % 60).padStart(2, "0")}m`;
    return `${Math.floor(s / 86400)}d${String(Math.floor(s / 3600) % 24).padStart(2, "0")}h`;
  }

  function clock(epoch) {
    return new Date(epoch * 1000).toLocaleTimeString([], { hour12: false });
  }

  // An age and a departure from the plan as `plan` words them (core/plan_explained.py: age, percent).
  function age(seconds) {
    if (seconds < 120) return `${seconds.toFixed(0)} s`;
    if (seconds < 7200) return `${(seconds / 60).toFixed(0)} min`;
    if (seconds < 172800) return `${(seconds / 3600).toFixed(0)} h`;
    return `${(seconds / 86400).toFixed(0)} days`;
  }

  function percent(drift) {
    return `${drift < 0 ? "-" : "+"}${Math.abs(100 * drift).toFixed(0)}%`;
  }

  // How the node's speed profile was taken and how long ago: "profiled 2 h ago", or "corrected from live times
  // 3 min ago" once the controller corrected it from the relay's times.
  function profileNote(node) {
    if (node.profiled_at === null) return "-";
    const how = node.profile_source === "live" ? "corrected from live times" : "profiled";
    return `${how} ${age(Math.max(0, Date.now() / 1000 - node.profiled_at))} ago`;
  }

  // Failed, or being tried again after failing: no plan counts on it (NodeStatus.left_out).
  function leftOut(node) {
    return node.state === "failed" || (node.failures > 0 && node.state !== "ready");
  }

  function layerText(layers, total) {
    if (!layers) return "-";
    const [first, last] = layers;
    return `${first === last ? first : `${first}-${last}`} of ${total}`;
  }

  // What the worker holds of its node's memory: device memory on GPU nodes, else its resident memory, against
  // the node's memory or its cap (the inventory's `memory:`) where that is less: the planner uses no more.
  function memory(node) {
    let used;
    let total;
    if (node.gpu_mem_used !== null && node.gpu_mem_total) {
      [used, total] = [node.gpu_mem_used, node.gpu_mem_total];
    } else if (node.mem_total) {
      [used, total] = [node.rss, node.mem_total];
    } else {
      return null;
    }
    if (node.mem_cap !== null) total = Math.min(total, node.mem_cap);
    return { used, total };
  }

  // --- the page ---------------------------------------------------------------------------------------

  function cell(row, field, className = "") {
    const td = document.createElement("td");
    td.dataset.field = field;
    if (className) td.className = className;
    row.appendChild(td);
    return td;
  }

  function nodeRow(name) {
    const row = document.createElement("tr");
    row.dataset.node = name;
    for (const field of ["name", "host", "platform"]) cell(row, field);
    const state = cell(row, "state-cell");
    state.innerHTML = '<span class="state" data-field="state"></span><small data-field="last"></small>';
    cell(row, "layers").innerHTML = '<span data-field="layer-text"></span><div class="bar"><div></div></div>';
    cell(row, "memory").innerHTML = '<span data-field="memory-text"></span><div class="bar"><div></div></div>';
    for (const field of ["measured", "planned"]) cell(row, field, "number");
    cell(row, "live", "number").innerHTML = '<span data-field="live-text"></span><small data-field="drift"></small>';
    cell(row, "profile");
    for (const field of ["restarts", "failures"]) cell(row, field, "number");
    return row;
  }

  function renderNode(row, node, nLayers) {
    const field = (name) => row.querySelector(`[data-field="${name}"]`);
    setText(field("name"), node.name);
    setText(field("host"), node.kind === "local" ? "local" : node.host);
    setText(field("platform"), `${node.arch || "?"} / ${node.backend || "?"}`);
    field("platform").title = node.device || "";
    const state = field("state");
    setText(state, node.state);
    state.className = `state state-${node.state}`;
    setText(field("last"), node.last_status || (leftOut(node) ? node.last_error : ""));
    field("last").title = node.last_error || "";
    setText(field("layer-text"), layerText(node.layers, nLayers));
    const span = field("layers").querySelector(".bar > div");
    const [first, last] = node.layers || [0, -1];
    span.style.left = `${nLayers ? (100 * first) / nLayers : 0}%`;
    span.style.width = `${nLayers ? (100 * (last - first + 1)) / nLayers : 0}%`;
    const held = memory(node);
    setText(field("memory-text"), held === null ? "-"
      : `${held.used === null ? "-" : compact(held.used)} / ${compact(held.total)}`);
    field("memory").querySelector(".bar > div").style.width =
      `${held && held.used !== null ? Math.min(100, (100 * held.used) / held.total) : 0}%`;
    setText(field("measured"), node.layers ? number(node.compute_ms, 2) : "-");
    setText(field("planned"), node.layers ? number(node.predicted_ms, 2) : "-");
    // The median of its latest computes under the running plan, and how far that is from the planned share.
    setText(field("live-text"), node.layers ? number(node.live_ms, 2) : "-");
    setText(field("drift"), node.layers && node.drift !== null ? `${percent(node.drift)} vs planned` : "");
    setText(field("profile"), profileNote(node));
    setText(field("restarts"), String(node.restarts));
    // A stock worker (or one not probed yet) aborts instead of reporting a failed compute: nothing to count.
    setText(field("failures"), node.compute_status || node.compute_failures ? String(node.compute_failures) : "-");
  }

  function renderNodes(status) {
    const body = byId("nodes").tBodies[0];
    const rows = new Map([...body.rows].map((row) => [row.dataset.node, row]));
    status.nodes.forEach((node, index) => {
      let row = rows.get(node.name);
      if (!row) row = nodeRow(node.name);
      if (body.rows[index] !== row) body.insertBefore(row, body.rows[index] || null);
      rows.delete(node.name);
      renderNode(row, node, status.n_layers);
    });
    for (const gone of rows.values()) gone.remove();
  }

  function renderSummary(status) {
    setText(byId("cluster"), status.cluster);
    document.title = `${status.cluster} · ggml-cluster`;
    setText(byId("model"), status.model);
    const coordinator = byId("coordinator");
    setText(coordinator, status.coordinator.state);
    coordinator.className = `state state-${status.coordinator.state}`;
    const detail = [status.coordinator.progress, status.coordinator.restarts ? `restarts ${status.coordinator.restarts}` : ""];
    setText(byId("coordinator-detail"), detail.filter(Boolean).join(" · "));
    setText(byId("decode"), number(status.decode_tokens_per_s, 1, " tok/s"));
    setText(byId("decode-all"), status.slots > 1 ? `all ${status.aggregate_decode_tokens_per_s.toFixed(1)} tok/s` : "");
    // speculative decoding: drafted tokens the model kept took no decode step of their own
    setText(byId("drafts"), status.tokens_drafted ? `drafts kept ${status.tokens_accepted} / ${status.tokens_drafted}` : "");
    setText(byId("prompt"), number(status.prompt_tokens_per_s, 0, " tok/s"));
    setText(byId("slots"), `${status.slots_busy} / ${status.slots}`);
    setText(byId("queue"), `${status.queue_length} / ${status.queue_limit}`);
    setText(byId("deferred"), `deferred ${status.requests_deferred} · rejected ${status.requests_rejected}`);
    setText(byId("requests"), String(status.requests_served));
    setText(byId("in-flight"), status.requests_in_flight ? `${status.requests_in_flight} in flight` : "");
    setText(byId("recoveries"), String(status.recoveries));
    setText(byId("predicted"), number(status.predicted_ms, 1, " ms/tok"));
    setText(byId("strategy"), status.strategy || "no plan yet");
  }

  function renderEvents(status) {
    const events = status.events;
    const key = events.length ? `${events.length}:${events[events.length - 1].time}` : "";
    if (key === eventsKey) return;
    eventsKey = key;
    const list = byId("events");
    list.replaceChildren(...events.slice().reverse().map((event) => {
      const item = document.createElement("li");
      item.dataset.kind = event.kind;
      const when = document.createElement("time");
      when.textContent = clock(event.time);
      const kind = document.createElement("span");
      kind.className = "kind";
      kind.textContent = event.kind;
      item.append(when, event.node ? `[${event.node}] ` : "", kind, `: ${event.message}`);
      return item;
    }));
  }

  // The plan's "why" comes from the controller (`plan --json`'s rows), asked again whenever the plan changes.
  function renderPlan(status) {
    const split = status.tensor_split.map((share) => share.toFixed(2)).join(", ");
    setText(byId("plan-summary"), status.strategy
      ? `${status.strategy} split [${split}], ${status.slots} slot(s), ${number(status.predicted_ms, 1, " ms/token")} predicted`
      : "no plan yet");
    const key = JSON.stringify([status.strategy, status.tensor_split,
      status.nodes.map((node) => [node.name, node.layers, leftOut(node)])]);
    if (key === planKey) return;
    planKey = key;
    fetch("plan", { cache: "no-store" }).then((answer) => (answer.ok ? answer.json() : null)).then((plan) => {
      if (plan === null) return;
      setText(byId("plan-problem"), plan.problem);
      byId("plan").tBodies[0].replaceChildren(...plan.rows.map((row) => {
        const line = document.createElement("tr");
        const values = [row.name, layerText(row.layers, status.n_layers), `${(100 * row.share).toFixed(1)}%`,
          number(row.predicted_ms, 2), row.why];
        values.forEach((value, index) => {
          const td = document.createElement("td");
          td.textContent = value;
          if (index === 2 || index === 3) td.className = "number";
          line.appendChild(td);
        });
        return line;
      }));
    }).catch(() => { planKey = null; });  // the controller is away: ask again with the next snapshot
  }

  // --- the charts -------------------------------------------------------------------------------------

  function sample(status) {
    const now = Date.now() / 1000;
    const times = history.time;
    const fresh = !times.length || now - times[times.length - 1] >= SAMPLE_GAP_S;
    const at = fresh ? times.length : times.length - 1;  // within the gap, the newest point is replaced
    times[at] = now;
    history.decode[at] = status.aggregate_decode_tokens_per_s;
    history.queue[at] = status.queue_length;
    history.busy[at] = status.slots_busy;
    for (const node of status.nodes) {
      if (!history.compute[node.name]) history.compute[node.name] = times.map(() => null);
      history.compute[node.name][at] = node.layers && node.compute_ms !== null ? node.compute_ms : null;
    }
    for (const values of Object.values(history.compute)) values.length = times.length;  // a node gone: gaps
    let old = 0;
    while (old < times.length && times[old] < now - HISTORY_S) old += 1;
    if (old) {
      for (const values of [times, history.decode, history.queue, history.busy, ...Object.values(history.compute)]) {
        values.splice(0, old);
      }
    }
  }

  function makeChart(id, series) {
    const container = byId(id);
    const options = {
      width: Math.max(200, container.clientWidth), height: 170, legend: { live: false },
      scales: { x: { time: true }, y: { range: (_, low, high) => [0, Math.max(1, high * 1.1)] } },
      axes: [{ stroke: "#8794a3", grid: { stroke: "#2a323d" } }, { stroke: "#8794a3", grid: { stroke: "#2a323d" } }],
      series: [{}, ...series.map((label, index) => ({
        label, stroke: PALETTE[index % PALETTE.length], width: 2, spanGaps: false, points: { show: false },
      }))],
    };
    if (charts[id]) charts[id].destroy();
    charts[id] = new uPlot(options, [[], ...series.map(() => [])], container);
  }

  function drawCharts(status) {
    const names = status.nodes.map((node) => node.name);
    if (!charts["chart-decode"]) {
      makeChart("chart-decode", ["tok/s"]);
      makeChart("chart-queue", ["queue", "slots busy"]);
    }
    const compute = charts["chart-compute"];
    if (!compute || compute.series.length - 1 !== names.length ||
        names.some((name, index) => compute.series[index + 1].label !== name)) {
      makeChart("chart-compute", names);
    }
    charts["chart-decode"].setData([history.time, history.decode]);
    charts["chart-queue"].setData([history.time, history.queue, history.busy]);
    charts["chart-compute"].setData([history.time, ...names.map((name) => history.compute[name])]);
  }

  window.addEventListener("resize", () => {
    for (const [id, chart] of Object.entries(charts)) {
      chart.setSize({ width: Math.max(200, byId(id).clientWidth), height: 170 });
    }
  });

  // --- the stream -------------------------------------------------------------------------------------

  function update(status) {
    latest = status;
    renderSummary(status);
    renderNodes(status);
    renderEvents(status);
    renderPlan(status);
    sample(status);
    drawCharts(status);
  }

  function connect() {
    const connection = byId("connection");
    const source = new EventSource("events");
    source.onopen = () => {
      setText(connection, "live");
      connection.className = "connection live";
    };
    source.onmessage = (message) => update(JSON.parse(message.data));
    source.onerror = () => {
      // EventSource reconnects by itself while the controller restarts; it gives up on a refusal (a new key).
      const closed = source.readyState === EventSource.CLOSED;
      setText(connection, closed ? "disconnected: reload the page" : "reconnecting…");
      connection.className = "connection lost";
    };
  }

  setInterval(() => {
    if (latest) setText(byId("uptime"), duration(Date.now() / 1000 - latest.started_at));
  }, 1000);

  // For the browser's console (and the browser tests): the latest snapshot, the charts' data and the charts.
  window.dashboard = { history, charts, latest: () => latest };
  connect();
})();
