// The status page's live part: polls /api/v1/swarm and redraws tables and SVG charts.
// Every peer-published string is untrusted: it only ever reaches the page through textContent
// or setAttribute on attributes that cannot execute (class, data-*, title); never innerHTML.
"use strict";
(function () {
  const REFRESH_MS = 5000;
  const SVG = "http://www.w3.org/2000/svg";
  let last = null;

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }
  function setText(id, text) { const n = document.getElementById(id); if (n) n.textContent = text; }
  function num(x, digits) { return (typeof x === "number" && isFinite(x)) ? x.toFixed(digits) : "–"; }
  function bytes(n) {
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
  }
  function compact(n) {
    if (!isFinite(n)) return "–";
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (n / 1e3).toFixed(1) + "k";
    return a >= 10 ? n.toFixed(0) : n.toPrecision(3);
  }
  function replaceRows(tbody, rows) { tbody.replaceChildren(...rows); }

  function renderTotals(s) {
    const verdict = document.getElementById("verdict");
    verdict.textContent = s.healthy ? "healthy" : "unhealthy";
    verdict.className = "verdict " + (s.healthy ? "ok" : "bad");
    const t = s.totals;
    setText("u-version", s.u_version);
    setText("t-peers", t.peers_online);
    setText("t-capacity", num(t.capacity_tokens_per_s, 0) + " tok/s");
    setText("t-tokens", t.tokens_trained);
    setText("t-loss", num(t.loss, 3));
    setText("t-traffic", bytes(t.bytes_sent) + " / " + bytes(t.dense_equivalent_bytes));
    setText("t-ratio", t.compression_ratio !== null ? num(100 * t.compression_ratio, 2) + "% of dense"
      : "manifest: " + num(100 * t.manifest_bytes_ratio, 2) + "% of dense");
    setText("updated", new Date(s.time * 1000).toLocaleTimeString());
  }

  function renderWarnings(s) {
    const items = s.warnings.map((w) => el("li", { class: w.level },
      w.message + (w.stage !== null && w.stage !== undefined ? " (stage " + w.stage + ")" : "")));
    if (!items.length) items.push(el("li", { class: "none" }, "none"));
    document.getElementById("warnings").replaceChildren(...items);
  }

  function renderStages(s) {
    const rows = s.stages.map((row) => {
      const serves = row.peers_serving && !(row.empty_lanes && row.empty_lanes.length);
      const tr = el("tr", { "data-stage": row.stage, class: serves ? "ok" : "empty" });
      tr.append(el("td", {}, row.stage), el("td", {}, row.layers[0] + "–" + (row.layers[1] - 1)),
        el("td", { class: "peers-online" }, row.peers_online), el("td", { class: "peers-total" }, row.peers_total),
        el("td", {}, num(row.throughput, 0) + " tok/s"), el("td", {}, row.load),
        el("td", { class: "audited " + (row.audited ? "ok" : "unaudited") }, row.audited ? "yes" : "no"));
      if (s.lanes > 1) tr.append(lanesCell(row));
      return tr;
    });
    replaceRows(document.querySelector("#stage-table tbody"), rows);
  }

  // A context-parallel stage's lanes: "lane: serving peers", an empty lane marked (a trip needs every lane).
  function lanesCell(row) {
    const td = el("td", { class: "lanes" });
    td.append(...(row.lanes || []).map((l) => el("span", { class: "lane " + (l.empty ? "empty" : "ok"), "data-lane": l.lane },
      l.lane + ": " + (l.empty ? "empty" : l.peers_serving))));
    return td;
  }

  function renderPeers(s) {
    const rows = [];
    for (const row of s.stages) {
      for (const p of row.peers) {
        const tr = el("tr", { "data-stage": row.stage, class: p.state });
        const id = el("code", { title: p.peer_id }, p.peer_id.slice(0, 14));
        const idCell = el("td"); idCell.append(id);
        tr.append(el("td", {}, row.stage));
        if (s.lanes > 1) tr.append(el("td", { class: "lane" }, p.lane));
        tr.append(el("td", { class: "peer-name" }, p.public_name), idCell,
          el("td", {}, p.state), el("td", p.relay ? { class: "reach", title: "through relay " + p.relay } : { class: "reach" }, p.reachability || "?"), el("td", {}, num(p.throughput, 0)), el("td", {}, p.load),
          el("td", {}, "v" + p.u_version), el("td", {}, p.tokens), el("td", {}, num(p.seconds_since_seen, 0) + "s ago"));
        rows.push(tr);
      }
    }
    replaceRows(document.querySelector("#peer-table tbody"), rows);
  }

  // A line chart: series = [{cls, points: [[t, v], ...]}]; null values break the line.
  function chart(container, series) {
    const width = Math.max(240, container.clientWidth || 300), height = 180;
    const pad = { l: 44, r: 8, t: 8, b: 20 };
    const root = svg("svg", { viewBox: "0 0 " + width + " " + height, role: "img" });
    const pts = series.flatMap((s) => s.points.filter((p) => p[1] !== null && isFinite(p[1])));
    root.append(svg("line", { class: "axis", x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b }),
      svg("line", { class: "axis", x1: pad.l, y1: pad.t, x2: pad.l, y2: height - pad.b }));
    if (!pts.length) {
      root.append(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "no data yet"));
      container.replaceChildren(root);
      return;
    }
    let t0 = Math.min(...pts.map((p) => p[0])), t1 = Math.max(...pts.map((p) => p[0]));
    let v0 = Math.min(...pts.map((p) => p[1])), v1 = Math.max(...pts.map((p) => p[1]));
    if (t1 === t0) { t0 -= 1; t1 += 1; }
    if (v1 === v0) { v0 -= Math.abs(v0) * 0.1 + 1; v1 += Math.abs(v1) * 0.1 + 1; }
    const x = (t) => pad.l + (t - t0) / (t1 - t0) * (width - pad.l - pad.r);
    const y = (v) => height - pad.b - (v - v0) / (v1 - v0) * (height - pad.t - pad.b);
    for (const s of series) {
      let d = "", pen = false;
      for (const [t, v] of s.points) {
        if (v === null || !isFinite(v)) { pen = false; continue; }
        d += (pen ? "L" : "M") + x(t).toFixed(1) + " " + y(v).toFixed(1);
        pen = true;
      }
      if (d) root.append(svg("path", { class: "series " + s.cls, d: d }));
    }
    root.append(svg("text", { x: pad.l - 4, y: pad.t + 10, "text-anchor": "end" }, compact(v1)),
      svg("text", { x: pad.l - 4, y: height - pad.b, "text-anchor": "end" }, compact(v0)),
      svg("text", { x: pad.l, y: height - 4 }, new Date(t0 * 1000).toLocaleTimeString()),
      svg("text", { x: width - pad.r, y: height - 4, "text-anchor": "end" }, new Date(t1 * 1000).toLocaleTimeString()));
    container.replaceChildren(root);
  }

  function renderCharts(s) {
    const h = s.history || [];
    chart(document.getElementById("loss-chart"), [{ cls: "loss", points: h.map((r) => [r.time, r.loss]) }]);
    chart(document.getElementById("throughput-chart"), [
      { cls: "capacity", points: h.map((r) => [r.time, r.capacity]) },
      { cls: "rate", points: h.map((r) => [r.time, r.rate]) },
    ]);
  }

  function render(s) {
    last = s;
    renderTotals(s); renderWarnings(s); renderStages(s); renderPeers(s); renderCharts(s);
    document.body.setAttribute("data-rendered", "1");
  }

  async function refresh() {
    try {
      const response = await fetch("/api/v1/swarm?history=300", { cache: "no-store" });
      if (response.ok) render(await response.json());
      else setText("updated", "tracker answered " + response.status);
    } catch (err) {
      setText("updated", "tracker unreachable");
    }
  }

  window.addEventListener("resize", () => { if (last) renderCharts(last); });
  refresh();
  setInterval(refresh, REFRESH_MS);
})();
