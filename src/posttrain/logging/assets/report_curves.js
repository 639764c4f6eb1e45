// The run report's charts (posttrain/logging/report.py writes the data; uPlot, inlined before this, draws).
// One state for the page: the smoothing weight, what the x axis shows, the zoomed x range, and which charts
// have a log scale. A change rebuilds the charts from the data, so what is drawn always follows the state.
(function () {
  "use strict";
  const payload = JSON.parse(document.getElementById("curves-data").textContent);
  const runs = payload.runs, specs = payload.charts;
  const byId = (id) => document.getElementById(id);
  const state = { smoothing: Number(byId("c-smoothing").value), x: "step", range: null, log: new Set() };
  const plots = specs.map(() => null);
  const stepIndex = runs.map((run) => new Map(run.clock.step.map((step, i) => [step, i])));
  const AXIS = { step: "step", time: "training time", tokens: "tokens" };
  const HEIGHT = 220;

  function number(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "\u2014";
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    const a = Math.abs(v);
    if (a < 1e-3 || a >= 1e6) return v.toExponential(4).replace(/\.?0+e/, "e");
    return String(Number(v.toPrecision(6)));
  }
  function duration(s) {
    if (s < 60) return (Math.round(s * 10) / 10) + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + "m " + String(Math.round(s - 60 * m)).padStart(2, "0") + "s";
    return Math.floor(m / 60) + "h " + String(m % 60).padStart(2, "0") + "m";
  }
  function tokens(t) {
    const a = Math.abs(t);
    for (const [size, unit] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "k"]]) {
      if (a >= size) return Number((t / size).toPrecision(3)) + unit;
    }
    return String(Math.round(t));
  }
  function xText(v) {
    if (v === null || v === undefined) return "\u2014";
    return state.x === "time" ? duration(v) : state.x === "tokens" ? tokens(v) : number(v);
  }

  function xOf(run, step) {
    if (state.x === "step") return step;
    const values = runs[run].clock[state.x];
    const i = stepIndex[run].get(step);
    return values && i !== undefined ? values[i] : null;
  }

  // TensorBoard's smoothing: an exponential moving average, debiased so the start is not pulled toward zero.
  function smooth(values, weight) {
    let last = 0, n = 0;
    return values.map((v) => {
      last = last * weight + (1 - weight) * v;
      n += 1;
      return last / (1 - Math.pow(weight, n));
    });
  }

  // uPlot wants one x array and one column per line (null where a line has no point).
  function chartData(spec) {
    const lines = [];
    for (const s of spec.series) {
      const xs = [], ys = [];
      s.steps.forEach((step, i) => {
        const x = xOf(s.run, step);
        if (x !== null) { xs.push(x); ys.push(s.values[i]); }
      });
      const sparse = s.steps.length <= payload.sparse_points;
      const line = { label: s.label, color: s.color, dash: s.dash, xs: xs, ys: ys, width: 1.6, points: sparse };
      if (!sparse && state.smoothing > 0) {
        lines.push({ label: s.label + " (raw)", color: s.color + "44", dash: s.dash, xs: xs, ys: ys, width: 1,
                     points: false, raw: true });
        line.ys = smooth(ys, state.smoothing);
      }
      lines.push(line);
    }
    const xs = [...new Set(lines.flatMap((line) => line.xs))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const columns = lines.map((line) => {
      const column = new Array(xs.length).fill(null);
      line.xs.forEach((x, i) => { column[at.get(x)] = line.ys[i]; });
      return column;
    });
    return { lines: lines, data: [xs, ...columns] };
  }

  // The y axis as wide as its longest tick label, so no label is cut.
  function axisSize(u, values, axisIndex) {
    const axis = u.axes[axisIndex];
    let size = axis.ticks.size + axis.gap;
    const longest = (values || []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), "");
    if (longest) {
      u.ctx.font = axis.font[0];
      size += u.ctx.measureText(longest).width / devicePixelRatio;
    }
    return Math.ceil(size) + 2;
  }

  function fullRange(u) {
    const xs = u.data[0];
    return { min: xs[0], max: xs[xs.length - 1] };
  }
  function applyRange() {
    for (const u of plots) {
      if (u && u.data[0].length) u.setScale("x", state.range || fullRange(u));
    }
    byId("c-range").textContent = state.range
      ? AXIS[state.x] + " " + xText(state.range.min) + " \u2013 " + xText(state.range.max) +
        " (double-click a chart or press reset to see it all)"
      : "drag across a chart to zoom all charts; double-click one to reset";
  }
  function onSelect(u) {
    if (u.select.width < 3) return;
    const min = u.posToVal(u.select.left, "x"), max = u.posToVal(u.select.left + u.select.width, "x");
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    state.range = { min: min, max: max };
    applyRange();
  }
  function resetZoom() {
    state.range = null;
    applyRange();
  }

  function build(index) {
    const figure = document.querySelector('figure[data-chart="' + index + '"]');
    const box = figure && figure.querySelector(".plot");
    if (!box) return;
    if (plots[index]) { plots[index].destroy(); plots[index] = null; }
    const { lines, data } = chartData(specs[index]);
    box.replaceChildren();
    if (!data[0].length) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "no " + AXIS[state.x] + " logged for this chart's runs";
      box.appendChild(empty);
      return;
    }
    const opts = {
      width: Math.max(240, box.clientWidth), height: HEIGHT,
      legend: { live: true },
      cursor: { sync: { key: "posttrain" }, drag: { x: true, y: false, setScale: false },
                bind: { dblclick: () => null } },
      scales: { x: { time: false }, y: { distr: state.log.has(index) ? 3 : 1 } },
      axes: [
        { label: AXIS[state.x], labelSize: 18, values: (u, splits) => splits.map(xText), size: 32 },
        { values: (u, splits) => splits.map(number), size: axisSize },
      ],
      series: [{ label: AXIS[state.x], value: (u, v) => xText(v) }].concat(lines.map((line) => ({
        label: line.label, stroke: line.color, width: line.width, dash: line.dash || undefined, spanGaps: true,
        points: line.points ? { show: true, size: 5, fill: line.color } : { show: false },
        value: (u, v) => number(v),
      }))),
      hooks: { setSelect: [onSelect] },
    };
    const u = new uPlot(opts, data, box);
    u.over.addEventListener("dblclick", resetZoom);
    plots[index] = u;
    if (state.range) u.setScale("x", state.range);
  }
  function buildAll() { specs.forEach((_, i) => build(i)); }

  const smoothing = byId("c-smoothing"), shown = byId("c-smoothing-value");
  smoothing.addEventListener("input", () => {
    state.smoothing = Number(smoothing.value);
    shown.textContent = smoothing.value;
    buildAll();
  });
  byId("c-x").addEventListener("change", (event) => {
    state.x = event.target.value;
    state.range = null;
    buildAll();
    applyRange();
  });
  byId("c-reset").addEventListener("click", resetZoom);
  document.querySelectorAll("figure[data-chart]").forEach((figure) => {
    const index = Number(figure.dataset.chart);
    const box = figure.querySelector(".c-log");
    box.addEventListener("change", () => {
      if (box.checked) state.log.add(index); else state.log.delete(index);
      build(index);
    });
  });
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => {
      plots.forEach((u, i) => {
        const box = u && document.querySelector('figure[data-chart="' + i + '"] .plot');
        if (box) u.setSize({ width: Math.max(240, box.clientWidth), height: HEIGHT });
      });
    }, 150);
  });
  buildAll();
  // For whoever inspects the page (and the report's browser test): the charts and the state they follow.
  window.posttrainReport = { plots: plots, state: state, specs: specs };
})();
