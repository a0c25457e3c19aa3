// axon_nb training dashboard: progress, loss chart (training and eval, layout changes marked),
// memory and communication per rank. Plain DOM + SVG; the kernel sends new loss and eval points as
// {type: "append"} messages. export.py draws the same charts in Python for saved pages.

const TRAIN_COLOR = "#1f77b4";
const RANK_COLORS = ["#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"];
const EVAL_COLOR = "#c2185b";

function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function seconds(s) {
  if (s == null) return "–";
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return m < 60 ? `${m} min ${Math.round(s % 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}

function linePath(xs, ys, sx, sy) {
  let d = "";
  for (let i = 0; i < xs.length; i++) {
    if (ys[i] == null) continue;
    d += `${d ? "L" : "M"}${sx(xs[i]).toFixed(1)},${sy(ys[i]).toFixed(1)}`;
  }
  return d;
}

function evalText(evals) {
  const last = evals[evals.length - 1];
  if (!last) return "";
  const figures = Object.entries(last).filter(([k, v]) => k !== "step" && typeof v === "number")
    .map(([k, v]) => `${k} ${k === "samples" ? v : v.toPrecision(4)}`);
  return `eval at step ${last.step}: ${figures.join(" · ")}`;
}

function layoutText(changes) {
  return changes.map((c) =>
    `layout: ${c.from} → ${c.to} at step ${c.step} (moved in ${seconds(c.seconds)})`).join(" · ");
}

// A move to another strategy: a vertical line at its step, labelled at its foot (the loss
// curve of a resumed call starts there, high at the top left).
function drawChanges(chart, changes, sx, box) {
  const { W, T, H, B } = box;
  changes.forEach((c, i) => {
    const x = sx(c.step), right = x > W / 2;
    const mark = svg("g", { class: "axon-layout-change", "data-step": c.step });
    const tip = svg("title");
    tip.textContent = layoutText([c]);
    const label = svg("text", {
      x: right ? x - 3 : x + 3, y: H - B - 4 - 12 * i, "text-anchor": right ? "end" : "start",
      class: "axon-layout-label",
    });
    label.textContent = `${c.from} → ${c.to}`;
    mark.append(tip, svg("line", { x1: x, y1: T, x2: x, y2: H - B, class: "axon-layout-line" }), label);
    chart.append(mark);
  });
}

function drawLoss(box, series, perRank, changes = []) {
  const W = 460, H = 180, L = 48, R = 8, T = 8, B = 22;
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "axon-chart" });
  const evals = series.eval.filter((e) => e.loss != null && isFinite(e.loss));
  const xs = series.steps, lines = [series.global, evals.map((e) => e.loss)];
  if (perRank) lines.push(...series.per_rank);
  const all = lines.flat().filter((v) => v != null && isFinite(v));
  if (!xs.length || !all.length) {
    box.replaceChildren(el("div", { class: "axon-empty" }, ["waiting for the first steps…"]),
      el("div", { class: "axon-layout-text" }, [layoutText(changes)]));
    return;
  }
  const steps = [xs[0], xs[xs.length - 1], ...evals.map((e) => e.step), ...changes.map((c) => c.step)];
  const x0 = Math.min(...steps), x1 = Math.max(...steps, x0 + 1);
  const y0 = Math.min(...all), y1 = Math.max(...all, y0 + 1e-12);
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  chart.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axon-axis" }));
  chart.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axon-axis" }));
  for (const [y, label] of [[y1, y1], [y0, y0]]) {
    const t = svg("text", { x: L - 4, y: sy(y) + 4, "text-anchor": "end", class: "axon-tick" });
    t.textContent = label.toPrecision(3);
    chart.append(t);
  }
  for (const [x, anchor] of [[x0, "start"], [x1, "end"]]) {
    const t = svg("text", { x: sx(x), y: H - 6, "text-anchor": anchor, class: "axon-tick" });
    t.textContent = `step ${x}`;
    chart.append(t);
  }
  if (perRank) {
    series.per_rank.forEach((ys, r) => chart.append(svg("path", {
      d: linePath(xs, ys, sx, sy), class: "axon-rank-line", stroke: RANK_COLORS[r % RANK_COLORS.length],
    })));
  }
  drawChanges(chart, changes, sx, { W, T, H, B });
  chart.append(svg("path", { d: linePath(xs, series.global, sx, sy), class: "axon-loss-line" }));
  const legend = [["train loss", TRAIN_COLOR]];
  if (evals.length) {
    chart.append(svg("path", {
      d: linePath(evals.map((e) => e.step), evals.map((e) => e.loss), sx, sy), class: "axon-eval-line",
    }));
    for (const e of evals.length <= 200 ? evals : []) {
      chart.append(svg("circle", { cx: sx(e.step), cy: sy(e.loss), r: 2.5, class: "axon-eval-dot" }));
    }
    legend.push(["eval loss", EVAL_COLOR]);
  }
  legend.forEach(([label, color], i) => {
    const t = svg("text", { x: W - R - 4, y: T + 10 + 12 * i, "text-anchor": "end", class: "axon-legend", fill: color });
    t.textContent = label;
    chart.append(t);
  });
  box.replaceChildren(chart, el("div", { class: "axon-eval-text" }, [evalText(evals)]),
    el("div", { class: "axon-layout-text" }, [layoutText(changes)]));
}

function cell(key, value) {
  if (key === "steps" && Array.isArray(value) && value.length === 2) return `${value[0]}-${value[1]}`;
  if (Array.isArray(value)) {
    return value.map((v) => (Array.isArray(v) ? `${v[0]} ${Number(v[1]).toFixed(2)} ms` : `${v}`)).join(" · ");
  }
  if (typeof value !== "number" || Number.isInteger(value)) return `${value ?? "–"}`;
  return key.endsWith("share") ? `${(100 * value).toFixed(1)}%` : value.toPrecision(3);
}

function render({ model, el: root }) {
  let series = { steps: [], global: [], per_rank: [], eval: [] };
  let perRank = false;
  const head = el("div", { class: "axon-head" });
  const bar = el("progress", { class: "axon-progress", max: "1", value: "0" });
  const progressText = el("div", { class: "axon-progress-text" });
  const lossBox = el("div", { class: "axon-loss" });
  const toggle = el("input", { type: "checkbox" });
  const redraw = () => drawLoss(lossBox, series, perRank, model.get("layout_changes") || []);
  const memoryBox = el("div", { class: "axon-memory" });
  const commBox = el("div", { class: "axon-comm" });
  const expertBox = el("div", { class: "axon-experts" });
  const errors = el("div", { class: "axon-errors" });
  const hang = el("pre", { class: "axon-hang" });
  const traceBox = el("div", { class: "axon-trace" });
  toggle.addEventListener("change", () => { perRank = toggle.checked; redraw(); });
  root.classList.add("axon-dashboard");
  root.append(
    head, bar, progressText,
    el("div", { class: "axon-section" }, ["Loss (global mean) ", el("label", {}, [toggle, " per rank"])]),
    lossBox,
    el("div", { class: "axon-section" }, ["Memory per rank"]), memoryBox,
    el("div", { class: "axon-section" }, ["Communication per rank (per step)"]), commBox,
    expertBox, traceBox, errors, hang,
  );

  function drawTrace() {
    const rows = (model.get("trace_summary") || []).map((t, rank) => ({ rank, ...(t || {}) }));
    const keys = [...new Set(rows.flatMap((r) => Object.keys(r)))].filter((k) => k !== "path");
    traceBox.replaceChildren(...(rows.length ? [
      el("div", { class: "axon-section" }, ["Trace summary"]),
      el("table", { class: "axon-table" }, [
        el("tr", {}, keys.map((k) => el("th", {}, [k]))),
        ...rows.map((r) => el("tr", {}, keys.map((k) => el("td", {}, [cell(k, r[k])])))),
      ]),
    ] : []));
  }

  function drawHead() {
    const chips = model.get("ranks").map((r) =>
      el("span", { class: `axon-chip axon-${r.status}`, title: r.error || r.status, "data-rank": r.rank },
        [`rank ${r.rank}: ${r.status}`]));
    head.replaceChildren(el("strong", {}, [model.get("title") || "training"]), ...chips);
    const failed = model.get("ranks").filter((r) => r.error);
    errors.replaceChildren(...failed.map((r) => el("div", { class: "axon-error" }, [`rank ${r.rank}: ${r.error}`])));
  }

  function drawHang() {
    hang.textContent = model.get("hang_report") || "";
    hang.style.display = hang.textContent ? "" : "none";
  }

  function drawProgress() {
    const p = model.get("progress");
    const span = Math.max(1, (p.total || 0) - (p.start || 0));
    bar.value = Math.min(1, ((p.step || 0) - (p.start || 0)) / span);
    const eta = model.get("frozen") ? "done" : `ETA ${seconds(p.eta_s)}`;
    const saved = p.checkpoint ? ` · checkpoint at step ${p.checkpoint.step}` : "";
    const notes = (p.notes || []).length ? ` · ${p.notes.join(" · ")}` : "";
    const loss = p.loss == null ? "" : ` · loss ${Number(p.loss.toPrecision(4))}`;
    progressText.textContent =
      `step ${p.step || 0} / ${p.total || 0} · ${seconds(p.elapsed_s || 0)} · ${eta} · ` +
      `${Math.round(p.samples_per_s || 0)} samples/s${loss}${saved}${notes}`;
    progressText.setAttribute("data-step", p.step || 0);
  }

  function drawMemory() {
    const rows = model.get("memory");
    const top = Math.max(1, ...rows.map((r) => Math.max(r.peak || 0, r.held || 0)));
    memoryBox.replaceChildren(...rows.map((r) => el("div", { class: "axon-row" }, [
      el("span", { class: "axon-label" }, [`rank ${r.rank}`]),
      el("div", { class: "axon-bar" }, [
        el("div", { class: "axon-bar-peak", style: `width:${(100 * (r.peak || 0)) / top}%` }),
        el("div", { class: "axon-bar-held", style: `width:${(100 * (r.held || 0)) / top}%` }),
      ]),
      el("span", { class: "axon-value" }, [
        `${bytes(r.held)} (peak ${bytes(r.peak)}${r.peak_phase ? ` in ${r.peak_phase}` : ""})` +
          (r.cuda_reserved != null ? ` · reserved ${bytes(r.cuda_reserved)}` : "") +
          (r.gpu_util != null
            ? ` · util ${r.gpu_util}% · memory bandwidth ${r.memory_bw_util}%` : "") +
          (r.rss_bytes ? ` · RSS ${bytes(r.rss_bytes)}` : ""),
      ]),
    ])));
  }

  function drawComm() {
    const rows = model.get("communication");
    commBox.replaceChildren(...rows.map((r) => {
      const kinds = Object.entries(r.per_step).map(([kind, c]) =>
        `${kind} ${bytes(c.bytes)} in ${(1000 * c.time_s).toFixed(2)} ms`);
      return el("div", { class: "axon-row" }, [
        el("span", { class: "axon-label" }, [`rank ${r.rank}`]),
        el("div", { class: "axon-bar" }, [el("div", { class: "axon-bar-comm", style: `width:${100 * r.share}%` })]),
        el("span", { class: "axon-value" }, [`${(100 * r.share).toFixed(0)}% of time · ${kinds.join(" · ") || "–"}`]),
      ]);
    }));
  }

  function drawExperts() {
    // Expert parallelism: tokens routed to each expert in the latest step (load balance).
    const e = model.get("experts");
    if (!e) { expertBox.replaceChildren(); return; }
    const top = Math.max(1, ...e.total);
    expertBox.replaceChildren(
      el("div", { class: "axon-section" }, [
        `Tokens per expert (latest step) · busiest / mean ${e.imbalance.toFixed(2)}`]),
      ...e.total.map((n, i) => el("div", { class: "axon-row", "data-expert": i }, [
        el("span", { class: "axon-label" }, [`expert ${i}`]),
        el("div", { class: "axon-bar" }, [el("div", { class: "axon-bar-held", style: `width:${(100 * n) / top}%` })]),
        el("span", { class: "axon-value" }, [
          `${n} tokens · from ranks ${e.per_rank.map((t) => (t ? t[i] : "–")).join(" / ")}`]),
      ])),
    );
  }

  function setLoss() {
    const full = model.get("loss");
    series = {
      steps: [...(full.steps || [])], global: [...(full.global || [])],
      per_rank: (full.per_rank || []).map((s) => [...s]), eval: [...(full.eval || [])],
    };
    redraw();
  }

  model.on("msg:custom", (msg) => {
    if (msg.type !== "append") return;
    const last = series.steps.length ? series.steps[series.steps.length - 1] : -Infinity;
    for (const [step, loss] of msg.points) {
      if (step <= last) continue;
      series.steps.push(step);
      series.global.push(loss);
      series.per_rank.forEach((s) => s.push(null));
    }
    const lastEval = series.eval.length ? series.eval[series.eval.length - 1].step : -Infinity;
    for (const e of msg.evals || []) if (e.step > lastEval) series.eval.push(e);
    redraw();
    root.setAttribute("data-points", series.steps.length);
  });
  for (const [name, draw] of [["ranks", drawHead], ["title", drawHead], ["progress", drawProgress],
    ["frozen", drawProgress], ["memory", drawMemory], ["communication", drawComm], ["experts", drawExperts], ["loss", setLoss],
    ["layout_changes", redraw], ["hang_report", drawHang],
    ["trace_summary", drawTrace]]) {
    model.on(`change:${name}`, draw);
  }
  drawHead(); drawProgress(); drawMemory(); drawComm(); drawExperts(); setLoss(); drawHang(); drawTrace();
}

export default { render };
