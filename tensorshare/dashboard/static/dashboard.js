// tensorshare dashboard: one event stream, every view updated in place.
// Everything a server sends (bin names above all) goes into the page as text
// (textContent, attribute values), never as HTML.
"use strict";

(function () {
  const SERVER_HISTORY = 300;  // samples of requests/s and MB/s kept per server
  const BIN_HISTORY = 60;      // samples per bin sparkline
  const SVG = "http://www.w3.org/2000/svg";

  const state = {
    snap: null,
    seq: 0,
    streamOk: null,  // null: not known yet; false: the stream failed
    history: new Map(),   // server index -> {requests: [], in: [], out: []}
    sparks: new Map(),    // bin key -> [ops/s, ...]
    rows: new Map(),      // bin key -> <tr>
    cards: new Map(),     // server index -> card elements
    filter: "",
  };

  // -- small helpers ----------------------------------------------------------------------
  function $(id) { return document.getElementById(id); }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function cell(tr, cls, text) {
    const td = el("td", cls, text);
    tr.appendChild(td);
    return td;
  }

  function setText(node, text) {
    const t = text === undefined || text === null ? "" : String(text);
    if (node.textContent !== t) node.textContent = t;
  }

  // Sizes in binary units, as the server counts its limits (rates stay MB/s).
  function fmtBytes(n) {
    if (n === null || n === undefined) return "-";
    if (n < 1024) return Math.round(n) + " B";
    const units = ["KiB", "MiB", "GiB", "TiB"];
    for (let i = 0; i < units.length; i++) {
      n /= 1024;
      if (n < 1023.95 || i === units.length - 1) return n.toFixed(1) + " " + units[i];
    }
    return "";
  }

  function fmtAge(s) {
    s = Math.max(s, 0);
    if (s < 10) return s.toFixed(1) + "s";
    if (s < 60) return Math.floor(s) + "s";
    let m = Math.floor(s / 60); const sec = Math.floor(s % 60);
    if (m < 60) return m + "m" + String(sec).padStart(2, "0") + "s";
    let h = Math.floor(m / 60); m %= 60;
    if (h < 24) return h + "h" + String(m).padStart(2, "0") + "m";
    const d = Math.floor(h / 24); h %= 24;
    return d + "d" + String(h).padStart(2, "0") + "h";
  }

  function fmtRate(r, digits) {
    if (r === null || r === undefined) return "-";
    return r.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
  }

  function fmtMs(ms, above, bounds) {
    if (above) return "> " + bounds;
    if (ms === null || ms === undefined) return "-";
    return (ms < 10 ? ms.toPrecision(3) : ms.toFixed(0)) + " ms";
  }

  function dash(v) { return v === null || v === undefined ? "-" : String(v); }

  function push(list, value, max) {
    list.push(value);
    while (list.length > max) list.shift();
  }

  function binKey(server, name) { return server + "\u0000" + name; }

  // A sparkline: one <polyline> scaled to its own maximum, newest on the right.
  function sparkline(svg, values, cls, slots) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const w = 100, h = 20;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.setAttribute("preserveAspectRatio", "none");
    if (!values.length) return;
    const top = Math.max(...values, 0);
    const n = Math.max(slots, values.length);
    const step = n > 1 ? w / (n - 1) : w;
    const x0 = w - step * (values.length - 1);
    const pts = values.map(function (v, i) {
      const y = top > 0 ? h - 1 - (v / top) * (h - 2) : h - 1;
      return (x0 + i * step).toFixed(2) + "," + y.toFixed(2);
    });
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", cls);
    line.setAttribute("points", pts.join(" "));
    svg.appendChild(line);
  }

  function multiline(svg, series, slots) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const w = 300, h = 56;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.setAttribute("preserveAspectRatio", "none");
    let top = 0;
    for (const s of series) for (const v of s.values) top = Math.max(top, v);
    for (const s of series) {
      if (!s.values.length) continue;
      const step = w / Math.max(slots - 1, 1);
      const x0 = w - step * (s.values.length - 1);
      const pts = s.values.map(function (v, i) {
        const y = top > 0 ? h - 2 - (v / top) * (h - 4) : h - 2;
        return (x0 + i * step).toFixed(1) + "," + y.toFixed(1);
      });
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("class", s.cls);
      line.setAttribute("points", pts.join(" "));
      svg.appendChild(line);
    }
    return top;
  }

  function svgEl() {
    return document.createElementNS(SVG, "svg");
  }

  // -- history ------------------------------------------------------------------------------
  function takeHistory(snap) {
    for (const s of snap.servers) {
      let h = state.history.get(s.index);
      if (snap.history && s.history) {
        h = {requests: s.history.requests.slice(-SERVER_HISTORY),
             in: s.history.in.slice(-SERVER_HISTORY), out: s.history.out.slice(-SERVER_HISTORY)};
        state.history.set(s.index, h);
      } else {
        if (!h) { h = {requests: [], in: [], out: []}; state.history.set(s.index, h); }
        if (s.up && s.rates && s.requests_per_s !== null) {
          push(h.requests, s.requests_per_s, SERVER_HISTORY);
          push(h.in, s.rates.in, SERVER_HISTORY);
          push(h.out, s.rates.out, SERVER_HISTORY);
        }
      }
    }
    const seen = new Set();
    for (const b of snap.bins) {
      const key = binKey(b.server, b.name);
      seen.add(key);
      if (snap.history) {
        state.sparks.set(key, (b.spark || []).slice(-BIN_HISTORY));
      } else if (b.rates) {
        const list = state.sparks.get(key) || [];
        push(list, b.rates.put + b.rates.append + b.rates.get, BIN_HISTORY);
        state.sparks.set(key, list);
      }
    }
    for (const key of Array.from(state.sparks.keys())) if (!seen.has(key)) state.sparks.delete(key);
  }

  // -- the servers ------------------------------------------------------------------------
  function fact(parent, label) {
    const f = el("div", "fact");
    f.appendChild(el("span", "label", label));
    const v = el("span", "value", "-");
    f.appendChild(v);
    parent.appendChild(f);
    return v;
  }

  function makeCard(index) {
    const card = el("div", "card");
    card.dataset.server = String(index);
    const title = el("h3");
    const name = el("span", "address");
    const role = el("span", "muted");
    const ident = el("span", "muted");
    title.append(name, role, ident);
    card.appendChild(title);
    const facts = el("div", "facts");
    const c = {card: card, name: name, role: role, ident: ident};
    for (const [key, label] of [["uptime", "uptime"], ["connections", "connections"],
      ["sessions", "sessions"], ["listeners", "listeners"], ["bins", "bins"],
      ["requests", "requests/s"], ["waiting", "waiting"], ["persistence", "data log"],
      ["replication", "replication"]]) {
      c[key] = fact(facts, label);
      c[key].classList.add("fact-" + key);
    }
    c.replication.parentNode.classList.add("wide");  // (a line per replica set: the card's width)
    card.appendChild(facts);
    const mem = el("div", "memory");
    const memTitle = el("div", "label");
    const bar = el("div", "bar");
    const legend = el("div", "legend");
    const kinds = el("div", "legend muted");
    mem.append(memTitle, bar, legend, kinds);
    card.appendChild(mem);
    c.memTitle = memTitle; c.bar = bar; c.legend = legend; c.kinds = kinds;
    const charts = el("div", "charts");
    for (const key of ["reqChart", "ioChart"]) {
      const box = el("div", "chart " + key);
      const lab = el("div", "label");
      const left = el("span");
      const right = el("span");
      lab.append(left, right);
      const svg = svgEl();
      box.append(lab, svg);
      charts.appendChild(box);
      c[key] = {svg: svg, span: left, top: right};
    }
    card.appendChild(charts);
    $("servers").appendChild(card);
    return c;
  }

  function renderMemory(c, s, bins) {
    const mem = s.stats.memory;
    const max = mem.max_memory;
    const whole = max || Math.max(mem.total, 1);
    setText(c.memTitle, "memory held " + fmtBytes(mem.total) +
      (max ? " of max_memory " + fmtBytes(max) + " (" + (100 * mem.total / max).toFixed(1) + "%)" : " (no limit)"));
    while (c.bar.firstChild) c.bar.removeChild(c.bar.firstChild);
    while (c.legend.firstChild) c.legend.removeChild(c.legend.firstChild);
    for (const part of ["stored", "sessions", "output", "receiving"]) {
      const n = mem[part] || 0;
      const seg = el("span", "seg-" + part);
      seg.style.width = Math.min(100, 100 * n / whole) + "%";
      seg.title = part + " " + fmtBytes(n);
      c.bar.appendChild(seg);
      const item = el("span");
      item.appendChild(el("i", "seg-" + part));
      item.appendChild(document.createTextNode(part + " " + fmtBytes(n)));
      c.legend.appendChild(item);
    }
    const byKind = {};
    for (const b of bins) byKind[b.kind] = (byKind[b.kind] || 0) + b.nbytes;
    const parts = Object.keys(byKind).sort().map(function (k) { return k + " " + fmtBytes(byKind[k]); });
    setText(c.kinds, parts.length ? "stored by kind: " + parts.join(", ") : "");
  }

  // A server's replication (its stats' role, term and replication map), as monitor shows it:
  // on a primary each replica's offset and lag, on a replica its primary and lag; resyncs.
  function replicationText(st) {
    const r = st.replication;
    if (!r) return "";
    let text = st.role + ", term " + st.term + ", offset " + r.offset;
    if (r.primary !== undefined) {
      text += "; replica of " + r.primary + ", " + (!r.synced ? "not synced" :
        "lag " + (r.lag_s === null ? "-" : r.lag_s.toFixed(3) + " s"));
    } else {
      const reps = (r.replicas || []).map(function (x) {
        return (x.address || "?") + " at " + x.offset + ", lag " + fmtBytes(x.lag_bytes) +
          " / " + x.lag_s.toFixed(3) + " s" + (x.live ? "" : " (not live)");
      });
      text += "; " + (reps.length ? reps.join("; ") : "no replicas");
    }
    return text + "; resyncs " + r.full_resyncs + " full, " + r.partial_resyncs + " partial";
  }

  function renderServers(snap) {
    const alive = new Set();
    for (const s of snap.servers) {
      alive.add(s.index);
      let c = state.cards.get(s.index);
      if (!c) { c = makeCard(s.index); state.cards.set(s.index, c); }
      c.card.classList.toggle("down", !s.up);
      setText(c.name, s.address);
      const role = s.role === "relay" ? "relay of #" + s.relay_of : s.role;
      setText(c.role, (snap.servers.length > 1 ? "#" + s.index + " " : "") + role +
        (s.up ? "" : " — unreachable"));
      const st = s.stats;
      if (!st) { setText(c.ident, s.error || "connecting"); continue; }
      setText(c.ident, st.server + " · id " + st.server_id);
      setText(c.uptime, fmtAge(st.uptime));
      setText(c.connections, st.connections);
      setText(c.sessions, st.sessions + (st.sessions_detached ? " (" + st.sessions_detached + " detached)" : ""));
      setText(c.listeners, st.listeners - s.listening);
      c.listeners.title = "not counting this dashboard's " + s.listening;
      setText(c.bins, st.bins + (s.bins_shown < s.bins_total ? " (" + s.bins_shown + " shown)" : ""));
      setText(c.requests, fmtRate(s.requests_per_s, 1));
      setText(c.waiting, st.waiting.fetches + " fetches, " + st.waiting.appends + " appends");
      setText(c.persistence, st.persistence ? (st.persistence.writable ? "on, " + st.persistence.fsync : "refusing writes") : "off");
      setText(c.replication, replicationText(st));
      c.replication.parentNode.hidden = !st.replication;
      renderMemory(c, s, snap.bins.filter(function (b) { return b.server === s.index; }));
      const h = state.history.get(s.index) || {requests: [], in: [], out: []};
      // The charts span the samples there are (at least a minute, at most SERVER_HISTORY).
      const slots = Math.min(SERVER_HISTORY, Math.max(60, h.requests.length));
      const span = "last " + fmtAge(slots * snap.interval).replace(/^(\d+)m00s$/, "$1 min");
      const reqTop = multiline(c.reqChart.svg, [{values: h.requests, cls: "line-requests"}], slots);
      setText(c.reqChart.span, "requests/s, " + span);
      setText(c.reqChart.top, "max " + fmtRate(reqTop, 1));
      const ioTop = multiline(c.ioChart.svg, [{values: h.in, cls: "line-in"}, {values: h.out, cls: "line-out"}], slots);
      setText(c.ioChart.span, "MB/s in (green) and out (orange), " + span);
      setText(c.ioChart.top, "max " + fmtRate(ioTop, 2));
    }
    for (const [index, c] of Array.from(state.cards.entries())) {
      if (!alive.has(index)) { c.card.remove(); state.cards.delete(index); }
    }
  }

  function renderShards(snap) {
    const view = $("shards-view");
    view.hidden = snap.servers.length < 2;
    if (view.hidden) return;
    const body = $("shards").tBodies[0];
    const rows = [];
    for (const s of snap.servers) {
      const tr = el("tr");
      tr.dataset.server = String(s.index);
      const st = s.stats;
      const r = s.rates || {};
      cell(tr, "num", "#" + s.index);
      cell(tr, "name", s.address);
      cell(tr, "role", s.role === "relay" ? "relay of #" + s.relay_of : s.role);
      cell(tr, s.up ? "state" : "state lagging", s.up ? "up" : "unreachable: " + (s.error || ""));
      cell(tr, "num", st ? fmtAge(st.uptime) : "-");
      cell(tr, "num", st ? st.connections : "-");
      cell(tr, "num", st ? st.bins : "-");
      cell(tr, "num", st ? fmtBytes(st.memory.stored) : "-");
      cell(tr, "num", fmtRate(s.requests_per_s, 1));
      cell(tr, "num", fmtRate(r.in, 2));
      cell(tr, "num", fmtRate(r.out, 2));
      const behind = cell(tr, "num behind", s.role === "relay" ? s.bins_behind : "");
      if (s.bins_behind) behind.classList.add("lagging");
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  // -- the bins -----------------------------------------------------------------------------
  const BIN_CELLS = ["server", "name", "kind", "items", "bytes", "version", "behind", "listeners",
    "changed", "put", "append", "get", "in", "out", "spark", "first"];

  function makeRow(b) {
    const tr = el("tr");
    tr.dataset.bin = b.name;
    tr.dataset.server = String(b.server);
    tr.cells_ = {};
    for (const name of BIN_CELLS) {
      const numeric = ["items", "bytes", "version", "behind", "listeners", "changed", "put",
        "append", "get", "in", "out"].indexOf(name) >= 0;
      tr.cells_[name] = cell(tr, name + (numeric ? " num" : ""));
    }
    tr.cells_.spark.appendChild(svgEl());
    return tr;
  }

  function updateRow(tr, b, serverTime, relayed) {
    const c = tr.cells_;
    setText(c.server, "#" + b.server);
    setText(c.name, b.name);
    c.name.title = b.name;
    setText(c.kind, b.kind);
    setText(c.items, b.n_items);
    setText(c.bytes, fmtBytes(b.nbytes));
    setText(c.version, b.version);
    setText(c.behind, relayed && b.behind !== undefined ? b.behind : "");
    c.behind.classList.toggle("lagging", !!b.behind);
    setText(c.listeners, b.listeners - (b.own_listen ? 1 : 0));
    setText(c.changed, b.changed_at ? fmtAge(serverTime - b.changed_at) + " ago" : "never");
    const r = b.rates;
    for (const k of ["put", "append", "get"]) setText(c[k], r ? fmtRate(r[k], 1) : "-");
    for (const k of ["in", "out"]) setText(c[k], r ? fmtRate(r[k], 2) : "-");
    sparkline(c.spark.firstChild, state.sparks.get(binKey(b.server, b.name)) || [], "line-spark", BIN_HISTORY);
    const first = b.first === null || b.first === undefined ? "" : b.first;
    setText(c.first, b.last && b.last !== b.first ? first + " … " + b.last : first);
    c.first.title = c.first.textContent;
  }

  function renderBins(snap) {
    const table = $("bins");
    const body = table.tBodies[0];
    table.classList.toggle("no-shards", snap.servers.length < 2);
    const relays = snap.servers.some(function (s) { return s.role === "relay"; });
    table.classList.toggle("no-relays", !relays);
    const times = new Map(snap.servers.map(function (s) {
      return [s.index, s.stats ? s.stats.time : snap.time];
    }));
    const seen = new Set();
    let previous = null;
    const bins = snap.bins.slice().sort(function (a, b) {
      return a.name < b.name ? -1 : a.name > b.name ? 1 : a.server - b.server;
    });
    for (const b of bins) {
      const key = binKey(b.server, b.name);
      seen.add(key);
      let tr = state.rows.get(key);
      if (!tr) { tr = makeRow(b); state.rows.set(key, tr); }
      updateRow(tr, b, times.get(b.server), relays);
      const want = previous ? previous.nextSibling : body.firstChild;
      if (want !== tr) body.insertBefore(tr, want);
      previous = tr;
    }
    for (const [key, tr] of Array.from(state.rows.entries())) {
      if (!seen.has(key)) { tr.remove(); state.rows.delete(key); }
    }
    applyFilter();
    const total = snap.servers.reduce(function (n, s) { return n + s.bins_total; }, 0);
    setText($("bins-count"), bins.length + (total > bins.length ? " of " + total : ""));
    $("bins-empty").hidden = bins.length > 0;
  }

  function applyFilter() {
    const f = state.filter;
    for (const tr of state.rows.values()) {
      tr.hidden = f !== "" && tr.dataset.bin.toLowerCase().indexOf(f) < 0;
    }
    for (const id of ["streams", "services", "replays"]) {
      for (const tr of $(id).tBodies[0].rows) {
        tr.hidden = f !== "" && (tr.dataset.bin || "").toLowerCase().indexOf(f) < 0;
      }
    }
  }

  // -- streams and services -----------------------------------------------------------------
  function streamRows(b) {
    const st = b.stream;
    const rows = [];
    const producers = Object.keys(st.producers).map(function (k) {
      return k + ": " + st.producers[k].state;
    }).join(", ");
    const epoch = st.epoch + " (" + st.epoch_sent + "/" + (st.epoch_samples === null ? "?" : st.epoch_samples) + ")";
    const consumers = Object.keys(st.consumers);
    const head = el("tr");
    head.dataset.bin = b.name;
    cell(head, "name", b.name);
    cell(head, "num head", st.head);
    cell(head, "epoch", epoch);
    cell(head, "producers", producers || "none");
    cell(head, "consumer muted", consumers.length ? "" : "no consumers");
    cell(head, "state", st.finished ? "finished" : st.broken ? "broken" : "on_lag=" + st.on_lag);
    for (let i = 0; i < 7; i++) cell(head, "num");
    rows.push(head);
    for (const name of consumers) {
      const c = st.consumers[name];
      const tr = el("tr", "sub");
      tr.dataset.bin = b.name;
      tr.dataset.consumer = name;
      cell(tr, "name stream-cell", b.name);
      cell(tr, "num");
      cell(tr);
      cell(tr);
      cell(tr, "consumer", name);
      cell(tr, "state", c.state);
      cell(tr, "num cursor", dash(c.cursor));
      cell(tr, "num position", dash(c.position));
      const lag = cell(tr, "num lag", dash(c.lag));
      if (c.lag) lag.classList.add("lagging");
      cell(tr, "num stalled", c.stalled_s.toFixed(1) + "s");
      cell(tr, "num stall-total", c.stall_total_s.toFixed(1) + "s");
      cell(tr, "num missed", c.missed);
      cell(tr, "detached", c.state === "detached" ? "yes" : "no");
      rows.push(tr);
    }
    return rows;
  }

  function renderStreams(snap) {
    const streams = snap.bins.filter(function (b) { return b.kind === "stream" && b.stream; });
    $("streams-view").hidden = streams.length === 0;
    let rows = [];
    for (const b of streams) rows = rows.concat(streamRows(b));
    $("streams").tBodies[0].replaceChildren(...rows);
  }

  function histogramText(h) {
    // Items per priority bucket, the non-empty ones: "[lower edge, next): count".
    const parts = [];
    for (let i = 0; i < h.counts.length; i++) {
      if (h.counts[i]) parts.push(">=" + h.edges[i] + ": " + h.counts[i]);
    }
    return parts.join(", ") || "empty";
  }

  function renderReplays(snap) {
    const replays = snap.bins.filter(function (b) { return b.kind === "replay" && b.replay; });
    $("replays-view").hidden = replays.length === 0;
    const rows = replays.map(function (b) {
      const rp = b.replay;
      const lim = rp.limiter;
      const held = ["inserts", "samples"].filter(function (side) { return lim[side + "_blocked"]; });
      const tr = el("tr");
      tr.dataset.bin = b.name;
      cell(tr, "name", b.name);
      cell(tr, "num", rp.size + " / " + rp.max_size);
      cell(tr, "sampler", rp.sampler);
      cell(tr, "num", fmtRate(rp.inserts_per_s, 1));
      cell(tr, "num", fmtRate(rp.samples_per_s, 1));
      cell(tr, "num", rp.inserts);
      cell(tr, "num", rp.samples);
      cell(tr, "limiter", lim.kind + (lim.diff === null ? "" : " diff " + lim.diff) +
        (held.length ? ", " + held.join("+") + " held" : ""));
      cell(tr, "num", rp.waiting_inserts + " in, " + rp.waiting_samples + " out");
      cell(tr, "histogram", histogramText(rp.priority_histogram));
      return tr;
    });
    $("replays").tBodies[0].replaceChildren(...rows);
  }

  function renderServices(snap) {
    const services = snap.bins.filter(function (b) { return b.kind === "service" && b.service; });
    $("services-view").hidden = services.length === 0;
    const rows = services.map(function (b) {
      const sv = b.service;
      const tr = el("tr");
      tr.dataset.bin = b.name;
      cell(tr, "name", b.name);
      cell(tr, "num queue", sv.queue);
      cell(tr, "num hosts", sv.hosts);
      cell(tr, "num calls", fmtRate(sv.calls_per_s, 1));
      cell(tr, "num", sv.answered);
      cell(tr, "num", sv.failed);
      cell(tr, "num", sv.timed_out);
      cell(tr, "num", sv.mean_batch);
      cell(tr, "num", sv.latency_mean_ms.toFixed(2) + " ms");
      cell(tr, "num", sv.latency_max_ms.toFixed(2) + " ms");
      return tr;
    });
    $("services").tBodies[0].replaceChildren(...rows);
    const parts = [];
    for (const s of snap.servers) {
      const op = s.ops && s.ops.service_call;
      if (!op || !op.requests) continue;
      const bounds = lastBound(s);
      parts.push((snap.servers.length > 1 ? "#" + s.index + ": " : "") + "p50 " +
        fmtMs(op.p50_ms, op.p50_above, bounds) + ", p99 " + fmtMs(op.p99_ms, op.p99_above, bounds));
    }
    setText($("services-quantiles"), parts.length ?
      "call latency of all services (the server's service_call histogram): " + parts.join("; ") : "");
  }

  function lastBound(s) {
    const b = s.stats && s.stats.latency.buckets;
    return b && b.length ? (b[b.length - 1] * 1000).toPrecision(3) + " ms" : "";
  }

  // -- ops ----------------------------------------------------------------------------------
  function renderOps(snap) {
    const many = snap.servers.length > 1;
    $("ops").classList.toggle("no-shards", !many);
    $("events").classList.toggle("no-shards", !many);
    const rows = [];
    const events = [];
    for (const s of snap.servers) {
      if (!s.stats) continue;
      const bounds = lastBound(s);
      for (const op of Object.keys(s.ops).sort()) {
        const o = s.ops[op];
        const tr = el("tr");
        tr.dataset.op = op;
        cell(tr, "server", "#" + s.index);
        cell(tr, "name", op);
        cell(tr, "num requests", o.requests);
        cell(tr, "num", fmtRate(o.per_s, 1));
        cell(tr, "num", fmtBytes(o.bytes_in));
        cell(tr, "num", fmtBytes(o.bytes_out));
        cell(tr, "num", fmtMs(o.mean_ms, false, bounds));
        cell(tr, "num", fmtMs(o.p50_ms, o.p50_above, bounds));
        cell(tr, "num", fmtMs(o.p99_ms, o.p99_above, bounds));
        rows.push(tr);
      }
      const errors = s.stats.errors;
      for (const code of Object.keys(errors).sort()) {
        const tr = el("tr");
        cell(tr, "server", "#" + s.index);
        cell(tr, "lagging", "error: " + code);
        cell(tr, "num", errors[code]);
        events.push(tr);
      }
      const counters = s.stats.counters;
      for (const key of Object.keys(counters).sort()) {
        const tr = el("tr");
        cell(tr, "server", "#" + s.index);
        cell(tr, null, key);
        cell(tr, "num", counters[key]);
        events.push(tr);
      }
    }
    $("ops").tBodies[0].replaceChildren(...rows);
    $("events").tBodies[0].replaceChildren(...events);
  }

  // -- the banner and the status --------------------------------------------------------------
  function renderBanner(snap) {
    const down = snap ? snap.servers.filter(function (s) { return !s.up; }) : [];
    const lines = [];
    if (state.streamOk === false) {
      lines.push("The dashboard does not answer: reconnecting by itself" +
        (snap ? " (showing the last numbers)." : "."));
    }
    for (const s of down) {
      const since = s.down_since ? " since " + new Date(s.down_since * 1000).toLocaleTimeString() : "";
      lines.push("Server " + s.address + " is unreachable" + since + ": " + (s.error || "no answer") +
        (s.stats ? ". Showing its last numbers; reconnecting by itself." : ". Reconnecting by itself."));
    }
    const banner = $("banner");
    setText(banner, lines.join(" "));
    banner.hidden = lines.length === 0;
    const status = $("status");
    const ok = state.streamOk && down.length === 0 && snap;
    status.className = "status " + (ok ? "live" : state.streamOk && snap ? "down" : "stale");
    setText(status, ok ? "live" : state.streamOk === false ? "reconnecting" :
      snap ? "server unreachable" : "connecting");
  }

  function render(snap) {
    state.snap = snap;
    takeHistory(snap);
    renderServers(snap);
    renderShards(snap);
    renderBins(snap);
    renderStreams(snap);
    renderServices(snap);
    renderReplays(snap);
    renderOps(snap);
    renderBanner(snap);
    applyFilter();
    setText($("clock"), "updated " + new Date(snap.time * 1000).toLocaleTimeString());
  }

  // A listened bin changed: its row shows the new count and version now (the next
  // snapshot brings bytes and rates).
  function applyChanges(changes) {
    for (const ch of changes) {
      const tr = state.rows.get(binKey(ch.server, ch.bin));
      if (!tr) continue;
      if (ch.n_items !== null && ch.n_items !== undefined) setText(tr.cells_.items, ch.n_items);
      if (ch.version !== null && ch.version !== undefined) setText(tr.cells_.version, ch.version);
      tr.classList.remove("changed");
      void tr.offsetWidth;  // restart the highlight
      tr.classList.add("changed");
    }
  }

  // -- the event stream ---------------------------------------------------------------------
  let source = null;

  function connect() {
    source = new EventSource("events");
    source.addEventListener("open", function () {
      state.streamOk = true;
      renderBanner(state.snap);
    });
    source.addEventListener("snapshot", function (ev) {
      state.streamOk = true;
      render(JSON.parse(ev.data));
    });
    source.addEventListener("change", function (ev) {
      applyChanges(JSON.parse(ev.data));
    });
    source.addEventListener("error", function () {
      state.streamOk = false;
      renderBanner(state.snap);
      if (source.readyState === EventSource.CLOSED) {
        // Refused (a 401 or 503): the browser does not retry by itself; we do, slowly.
        source = null;
        setTimeout(connect, 5000);
      }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    $("filter").addEventListener("input", function (ev) {
      state.filter = ev.target.value.trim().toLowerCase();
      applyFilter();
    });
    renderBanner(null);
    connect();
  });
})();
