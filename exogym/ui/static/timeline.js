// The timeline of one run on a canvas: a lane per node (and the server, and the shared links that carried a
// flow: their busy time, links busy alike in one lane), spans in simulated time, messages as lines from send to arrival, server updates as marks. Spans narrower than a pixel are folded into one column per
// pixel showing the kind that filled most of it, so a run of any length draws in time proportional to the width.
"use strict";

const KIND_COLORS = {c: "#4c8bf5", m: "#f2a33a", i: "#d9d9d9", d: "#b3261e", s: "#a05cd6", b: "#2a9d8f"};
const KIND_ORDER = "cmidsb";

class Timeline {
  constructor(canvas, tip) {
    this.canvas = canvas; this.tip = tip; this.data = null; this.showMessages = true;
    this.labelW = 70; this.axisH = 22;
    canvas.addEventListener("wheel", (e) => this._wheel(e), {passive: false});
    canvas.addEventListener("mousedown", (e) => { this.drag = {x: e.clientX, v0: this.v0, v1: this.v1}; });
    window.addEventListener("mouseup", () => { this.drag = null; });
    canvas.addEventListener("mousemove", (e) => this._move(e));
    canvas.addEventListener("mouseleave", () => { this.tip.style.display = "none"; });
    canvas.addEventListener("dblclick", () => this.reset());
    window.addEventListener("resize", () => this.draw());
  }

  // data: a timeline.json object (exogym.runs.timeline's format)
  load(data) {
    this.data = data;
    this.lanes = data.lanes.map((lane) => ({name: lane.name, kind: lane.kind, t: Float64Array.from(lane.t),
                                            kinds: lane.kinds, steps: lane.steps, flows: lane.flows,
                                            links: lane.links || [lane.name]}));
    const m = data.messages, n = m.src.length;
    const order = Array.from({length: n}, (_, i) => i).sort((a, b) => m.sent[a] - m.sent[b]);
    this.msg = {n, src: Int32Array.from(order, (i) => m.src[i]), dst: Int32Array.from(order, (i) => m.dst[i]),
                sent: Float64Array.from(order, (i) => m.sent[i]), arrives: Float64Array.from(order, (i) => m.arrives[i]),
                bytes: Float64Array.from(order, (i) => m.bytes[i]), step: Int32Array.from(order, (i) => m.step[i])};
    this.maxFlight = 0;
    for (let i = 0; i < n; i++) this.maxFlight = Math.max(this.maxFlight, this.msg.arrives[i] - this.msg.sent[i]);
    this.upd = data.updates;
    const nodes = this.lanes.filter((l) => l.kind === "node").length;
    this.maxStale = Math.max(1, nodes - 1);  // a staleness of about K - 1 is what a round robin gives
    for (const s of this.upd.staleness) this.maxStale = Math.max(this.maxStale, s);
    this.serverLane = this.lanes.findIndex((l) => l.kind === "server");
    const ctx = this.canvas.getContext("2d");  // the labels' column fits the longest lane name (e.g. "access 12 down")
    ctx.font = "12px sans-serif";
    this.labelW = Math.max(70, ...this.lanes.map((l) => Math.ceil(ctx.measureText(l.name).width) + 10));
    this.reset();
  }

  reset() { if (!this.data) return; this.v0 = 0; this.v1 = this.data.end_s || 1; this.draw(); }

  _geometry() {
    const dpr = window.devicePixelRatio || 1, w = this.canvas.clientWidth, h = this.canvas.clientHeight;
    if (this.canvas.width !== Math.round(w * dpr) || this.canvas.height !== Math.round(h * dpr)) {
      this.canvas.width = Math.round(w * dpr); this.canvas.height = Math.round(h * dpr);
    }
    const laneH = Math.max(3, Math.min(28, (h - this.axisH) / Math.max(1, this.lanes.length)));
    return {dpr, w, h, laneH, axisH: this.axisH, plotW: w - this.labelW, scale: (w - this.labelW) / (this.v1 - this.v0)};
  }

  draw() {
    if (!this.data) return;
    const g = this._geometry(), ctx = this.canvas.getContext("2d");
    ctx.setTransform(g.dpr, 0, 0, g.dpr, 0, 0);
    ctx.clearRect(0, 0, g.w, g.h);
    const rects = {}; for (const k of KIND_ORDER) rects[k] = [];
    this.lanes.forEach((lane, li) => this._lane(lane, li, g, rects));
    for (const k of KIND_ORDER) {
      ctx.fillStyle = KIND_COLORS[k]; ctx.beginPath();
      const r = rects[k];
      for (let j = 0; j < r.length; j += 4) ctx.rect(r[j], r[j + 1], r[j + 2], r[j + 3]);
      ctx.fill();
    }
    this._updates(ctx, g);
    if (this.showMessages) this._messages(ctx, g);
    this._labels(ctx, g);
    this._axis(ctx, g);
  }

  // The spans of one lane in view: wide ones as they are, narrow ones folded into per-pixel columns.
  _lane(lane, li, g, rects) {
    const t = lane.t, n = lane.kinds.length, y = g.axisH + li * g.laneH, h = Math.max(1, g.laneH - 1);
    if (n === 0) return;
    let i = Math.max(0, upperBound(t, this.v0) - 1);
    const acc = new Float64Array(KIND_ORDER.length); let col = -1;
    const flush = () => {
      if (col < 0) return;
      let best = 0; for (let k = 1; k < KIND_ORDER.length; k++) if (acc[k] > acc[best]) best = k;
      rects[KIND_ORDER[best]].push(this.labelW + col, y, 1, h); acc.fill(0); col = -1;
    };
    for (; i < n && t[i] <= this.v1; i++) {
      const x0 = Math.max(0, (t[i] - this.v0) * g.scale), x1 = Math.min(g.plotW, (t[i + 1] - this.v0) * g.scale);
      if (x1 <= x0) continue;
      const k = lane.kinds[i];
      if (x1 - x0 >= 1) {
        flush(); rects[k].push(this.labelW + x0, y, x1 - x0, h);
      } else {
        const c = Math.floor(x0);
        if (c !== col) { flush(); col = c; }
        acc[KIND_ORDER.indexOf(k)] += x1 - x0;
      }
    }
    flush();
  }

  _laneY(li, g) { return g.axisH + li * g.laneH + g.laneH / 2; }

  _messages(ctx, g) {
    const m = this.msg; if (!m.n) return;
    // messages in view: sent before v1 and arriving after v0 (sent no earlier than v0 - the longest flight)
    const first = upperBound(m.sent, this.v0 - this.maxFlight), last = upperBound(m.sent, this.v1);
    const count = last - first, stride = Math.max(1, Math.ceil(count / 4000));
    ctx.strokeStyle = count > 4000 ? "rgba(60,60,60,0.25)" : "rgba(40,40,40,0.6)"; ctx.lineWidth = 1;
    ctx.beginPath();
    for (let i = first; i < last; i += stride) {
      if (m.arrives[i] < this.v0 || m.dst[i] < 0) continue;
      const x0 = this.labelW + (m.sent[i] - this.v0) * g.scale, x1 = this.labelW + (m.arrives[i] - this.v0) * g.scale;
      const y0 = this._laneY(m.src[i], g), y1 = this._laneY(m.dst[i], g);
      ctx.moveTo(x0, y0); ctx.lineTo(x1, y1);
      if (count <= 4000) { // an arrow head at the arrival
        const a = Math.atan2(y1 - y0, x1 - x0);
        ctx.moveTo(x1, y1); ctx.lineTo(x1 - 5 * Math.cos(a - 0.4), y1 - 5 * Math.sin(a - 0.4));
        ctx.moveTo(x1, y1); ctx.lineTo(x1 - 5 * Math.cos(a + 0.4), y1 - 5 * Math.sin(a + 0.4));
      }
    }
    ctx.stroke();
    document.getElementById("timeline-info").textContent =
      count > 4000 ? `${count} messages in view: every ${stride}th drawn; zoom in for all` : `${count} messages in view`;
  }

  _updates(ctx, g) {
    const u = this.upd; if (!u || !u.t.length || this.serverLane < 0) return;
    const y = g.axisH + this.serverLane * g.laneH, h = g.laneH - 1;
    const maxS = this.maxStale;
    const first = upperBound(u.t, this.v0) - 1, last = upperBound(u.t, this.v1);
    for (let i = Math.max(0, first); i < last; i++) {
      const x = this.labelW + (u.t[i] - this.v0) * g.scale, s = Math.min(1, u.staleness[i] / maxS);
      ctx.fillStyle = `rgb(${Math.round(40 + 200 * s)},${Math.round(160 - 120 * s)},60)`;
      ctx.fillRect(x - 1, y, 2, h);
    }
  }

  _labels(ctx, g) {
    ctx.fillStyle = "#fff"; ctx.fillRect(0, g.axisH, this.labelW - 2, g.h);
    ctx.fillStyle = "#333"; ctx.font = `${Math.min(12, Math.max(7, g.laneH - 2))}px sans-serif`;
    ctx.textBaseline = "middle";
    const every = Math.ceil(9 / g.laneH);
    this.lanes.forEach((lane, li) => {
      if (li % every === 0 || lane.kind !== "node") ctx.fillText(lane.name, 4, this._laneY(li, g));
    });
  }

  _axis(ctx, g) {
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, g.w, g.axisH);
    const span = this.v1 - this.v0, step = niceStep(span / 8);
    ctx.fillStyle = "#555"; ctx.strokeStyle = "#bbb"; ctx.font = "11px sans-serif"; ctx.textBaseline = "top";
    ctx.beginPath();
    for (let v = Math.ceil(this.v0 / step) * step; v <= this.v1; v += step) {
      const x = this.labelW + (v - this.v0) * g.scale;
      ctx.moveTo(x, g.axisH - 5); ctx.lineTo(x, g.axisH);
      ctx.fillText(fmtSeconds(v, step), x + 2, 3);
    }
    ctx.stroke();
    ctx.fillText("simulated s", 4, 3);
  }

  _wheel(e) {
    if (!this.data) return;
    e.preventDefault();
    const g = this._geometry(), x = e.offsetX - this.labelW;
    const at = this.v0 + x / g.scale, f = Math.exp(e.deltaY * 0.002);
    const w = Math.max((this.v1 - this.v0) * f, 1e-9);
    this.v0 = at - (at - this.v0) * (w / (this.v1 - this.v0)); this.v1 = this.v0 + w;
    this.draw();
  }

  zoomTo(v0, v1) { this.v0 = v0; this.v1 = v1; this.draw(); }

  _move(e) {
    if (!this.data) return;
    const g = this._geometry();
    if (this.drag) {
      const dv = (e.clientX - this.drag.x) / g.scale;
      this.v0 = this.drag.v0 - dv; this.v1 = this.drag.v1 - dv; this.draw(); return;
    }
    const text = this.describe(e.offsetX, e.offsetY);
    if (!text) { this.tip.style.display = "none"; return; }
    this.tip.textContent = text; this.tip.style.display = "block";
    this.tip.style.left = `${Math.min(e.offsetX + 14, g.w - 260)}px`; this.tip.style.top = `${e.offsetY + 14}px`;
  }

  // What is under the pointer at (x, y) in CSS pixels: a span with its steps and times, or a server update.
  describe(x, y) {
    const g = this._geometry(), li = Math.floor((y - g.axisH) / g.laneH), lane = this.lanes[li];
    if (!lane || x < this.labelW) return null;
    const at = this.v0 + (x - this.labelW) / g.scale;
    if (lane.kind === "server") {
      const u = this.upd; if (!u || !u.t.length) return "server";
      let i = upperBound(u.t, at); if (i > 0 && (i >= u.t.length || at - u.t[i - 1] < u.t[i] - at)) i -= 1;
      if (Math.abs(u.t[i] - at) * g.scale > 6) return "server";
      const node = u.lane[i] >= 0 ? this.lanes[u.lane[i]].name : "?";
      return `server update ${i + 1}\nfrom ${node}, staleness ${u.staleness[i]}\nat ${u.t[i].toFixed(4)} s`;
    }
    const i = upperBound(lane.t, at) - 1;
    if (i < 0 || i >= lane.kinds.length) return null;
    if (lane.kind === "link") {  // a shared link: busy while at least one flow crossed it
      const times = `${lane.t[i].toFixed(4)} s to ${lane.t[i + 1].toFixed(4)} s (${(lane.t[i + 1] - lane.t[i]).toFixed(4)} s)`;
      // links busy alike share a lane (exogym.runs.timeline): name them all, the first few in full
      const alike = lane.links.length > 1 ? `\n${lane.links.length} links alike: ${lane.links.slice(0, 4).join(", ")}` +
                                            (lane.links.length > 4 ? ", ..." : "") : "";
      return (lane.kinds[i] === "b" ? `${lane.name}: busy, at most ${lane.flows[i]} flow(s) at once\n${times}`
                                    : `${lane.name}: idle\n${times}`) + alike;
    }
    const kind = this.data.kinds[lane.kinds[i]], s0 = lane.steps[i];
    // the span ends in the step the next span began in, unless that one is computing: it began a new step
    const next = i + 1 < lane.kinds.length ? lane.kinds[i + 1] : null;
    const s1 = next === null ? null : lane.steps[i + 1] - ("cs".includes(next) ? 1 : 0);
    const steps = s1 === null ? `from step ${s0}` : s1 > s0 ? `steps ${s0} to ${s1}` : `step ${s0}`;
    let out = `${lane.name}: ${kind}, ${steps}\n${lane.t[i].toFixed(4)} s to ${lane.t[i + 1].toFixed(4)} s` +
              ` (${(lane.t[i + 1] - lane.t[i]).toFixed(4)} s)`;
    const sent = this._sentIn(li, lane.t[i], lane.t[i + 1]);
    if (sent.count) {
      const to = sent.first.dst >= 0 ? this.lanes[sent.first.dst].name : "?";
      out += `\nsent ${sent.count} message(s), ${fmtBytes(sent.bytes)}; first to ${to}, arriving ` +
             `${sent.first.arrives.toFixed(4)} s`;
    }
    return out;
  }

  _sentIn(li, a, b) {
    const m = this.msg, out = {count: 0, bytes: 0, first: null};
    for (let i = Math.max(0, upperBound(m.sent, a) - 1); i < m.n && m.sent[i] <= b; i++) {
      if (m.src[i] !== li || m.sent[i] < a) continue;
      out.count += 1; out.bytes += m.bytes[i];
      if (!out.first) out.first = {dst: m.dst[i], arrives: m.arrives[i]};
    }
    return out;
  }
}

// The first index whose value is greater than x in a sorted array.
function upperBound(a, x) {
  let lo = 0, hi = a.length;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (a[mid] <= x) lo = mid + 1; else hi = mid; }
  return lo;
}

function niceStep(raw) {
  const p = Math.pow(10, Math.floor(Math.log10(raw))), r = raw / p;
  return (r < 1.5 ? 1 : r < 3.5 ? 2 : r < 7.5 ? 5 : 10) * p;
}

function fmtSeconds(v, step) {
  const digits = Math.max(0, Math.min(9, -Math.floor(Math.log10(step))));
  return v.toFixed(digits);
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "";
  const units = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (b >= 1000 && i < units.length - 1) { b /= 1000; i += 1; }
  return `${b.toFixed(b < 10 && i ? 2 : 0)} ${units[i]}`;
}

window.ExoTimeline = {Timeline, KIND_COLORS, fmtBytes};
