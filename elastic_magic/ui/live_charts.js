// The live charts of a job, drawn with uPlot from what ui/charts.py's Charts.live() sends:
// the world size over time (each machine's ranks stacked, where there were several) with the
// timeline's marks (failures, restarts, resizes, machines, survivors; each mark's sentence
// on hover), steps per second on the same time axis, and each logged scalar over its steps.
// One file for both places that draw them: the dashboard widget (ui/dashboard.py puts
// uPlot, this file and dashboard.js together into its module) and the JupyterLab panel
// (bundled with uPlot from npm). uPlot is passed in, so this file imports nothing.

const GRID = "rgba(128, 128, 128, 0.22)";
const WHOLE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 1e5];

// The one time-of-day format (ui/describe.py's clock): 24-hour HH:MM:SS.
const two = (n) => String(n).padStart(2, "0");
const clockAt = (t) => {
  const d = new Date(t * 1000);
  return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
};

// Columns for uPlot ([xs, ys...]) from rows ([x, y...]).
const columns = (rows, width) =>
  Array.from({ length: width }, (_, i) => rows.map((row) => row[i]));

export function liveCharts(uPlot, box, { height = 130, compact = false } = {}) {
  const plots = new Map(); // panel name -> { plot, shape, node }
  const syncKey = `em-${Math.random().toString(36).slice(2)}`; // one cursor in time
  let marks = [];
  let span = null; // [from, to] of the time panels
  let colors = { series: ["#1f77b4"], marks: {} };

  const width = () => Math.max(120, (box.clientWidth || 640) - 4); // 640 until attached
  const ink = () => getComputedStyle(box).color || "#444";

  // Vertical dashed lines on the canvas, and over each an element with the mark's sentence
  // as its tooltip (a canvas has none) that a test can find. The elements stay from one
  // draw to the next (only moved): a tooltip being read stays open while the chart redraws.
  function drawMarks(u) {
    const { ctx, bbox } = u;
    ctx.save();
    ctx.setLineDash([4, 3]);
    ctx.lineWidth = Math.max(1, devicePixelRatio);
    const layer = u.over.querySelector(".em-marks") ||
      u.over.appendChild(Object.assign(document.createElement("div"), { className: "em-marks" }));
    const before = new Map([...layer.children].map((node) => [node.dataset.key, node]));
    const [low, high] = [u.scales.x.min, u.scales.x.max];
    for (const [time, label, sentence] of marks) {
      if (time < low || time > high) continue;
      const color = colors.marks[label] || ink();
      const x = Math.round(u.valToPos(time, "x", true));
      ctx.strokeStyle = color;
      ctx.beginPath();
      ctx.moveTo(x, bbox.top);
      ctx.lineTo(x, bbox.top + bbox.height);
      ctx.stroke();
      const key = `${time} ${label} ${sentence}`;
      let mark = before.get(key);
      before.delete(key);
      if (!mark) {
        mark = layer.appendChild(document.createElement("div"));
        Object.assign(mark, { className: "em-mark", title: `${clockAt(time)} ${sentence}` });
        Object.assign(mark.dataset, { em: "mark", kind: label, key });
      }
      mark.style.left = `${u.valToPos(time, "x") - 4}px`;
      mark.style.borderTopColor = color;
    }
    for (const gone of before.values()) gone.remove();
    ctx.restore();
  }

  // x: the time of day (the one clock format) or, with a label, steps; y: whole numbers
  // where the values are counts.
  function axes({ xLabel, counts = false } = {}) {
    const axis = { stroke: ink(), grid: { stroke: GRID, width: 1 },
                   ticks: { stroke: GRID, width: 1 },
                   ...(compact ? { font: "10px sans-serif" } : {}) };
    const x = xLabel ? { ...axis, label: xLabel, labelSize: 14, incrs: WHOLE }
      : { ...axis, space: 70, values: (_u, splits, _axis, _space, step) =>
            splits.map((t) => (step < 1 ? `${clockAt(t)}.${Math.floor((t % 1) * 10)}` : clockAt(t))) };
    const y = { ...axis, size: compact ? 30 : 48, ...(counts ? { incrs: WHOLE } : {}) };
    return [compact ? { ...x, size: 22 } : x, y];
  }

  // One chart: made anew when its shape (its series) or the theme's ink changes (uPlot
  // draws its axes in the colours it was made with), else given the new data.
  function show(name, title, series, data, options, { synced = true } = {}) {
    const shape = `${series}|${ink()}`;
    let entry = plots.get(name);
    if (entry && entry.shape !== shape) {
      entry.plot.destroy();
      entry.node.remove();
      entry = undefined;
    }
    if (!entry) {
      const node = document.createElement("div");
      node.className = "em-chart";
      node.dataset.em = "chart";
      node.dataset.chart = name;
      node.dataset.ink = ink();
      box.appendChild(node);
      // The time panels move one cursor together; no drag-to-zoom (new data would undo it).
      const cursor = { drag: { x: false, y: false }, ...(synced ? { sync: { key: syncKey } } : {}) };
      const plot = new uPlot({
        title: compact ? undefined : title, width: width(), height,
        legend: { show: !compact }, cursor, ...options,
      }, data, node);
      entry = { plot, shape, node };
      plots.set(name, entry);
    } else {
      entry.plot.setData(data);
    }
    entry.node.dataset.points = String(data[0].length);
  }

  function drop(keep) {
    for (const [name, entry] of plots) {
      if (!keep.has(name)) {
        entry.plot.destroy();
        entry.node.remove();
        plots.delete(name);
      }
    }
  }

  // Several machines: each one's ranks a band, stacked up to the world size, the top one
  // first; each band filled between its edge and the next one's (uPlot's bands), the
  // lowest down to 0. The legend tells each machine's own ranks.
  function machineBands(rows, names, line, world) {
    const count = names.length;
    const stacked = rows.map(([, ...ranks]) => ranks.map((_, i) => ranks.slice(0, i + 1)
      .reduce((a, b) => a + b, 0)));
    const order = names.map((_, i) => count - 1 - i);
    const own = (u, _v, si, idx) => (idx == null ? "--"
      : String(u.data[si][idx] - (si < count ? u.data[si + 1][idx] : 0)));
    const layers = order.map((i) => {
      const color = colors.series[2 + (i % (colors.series.length - 2))];
      return { ...line, label: names[i], stroke: color, width: 1, fill: `${color}59`, value: own };
    });
    const data = [rows.map((r) => r[0]), ...order.map((i) => stacked.map((s) => s[i])),
                  stacked.map((s) => s[count - 1])];
    const between = order.slice(0, -1).map((_, s) => ({ series: [s + 1, s + 2] }));
    return [data, [...layers, world], between];
  }

  function update(chart) {
    if (!chart || !chart.sizes) return;
    colors = chart.colors || colors;
    marks = chart.marks || [];
    const keep = new Set();
    const now = Date.now() / 1000;
    // A running job's lines reach the present: its last value holds until now.
    const upToNow = (rows) => (chart.final || rows.length === 0 ? rows
      : [...rows, [Math.max(now, rows[rows.length - 1][0]), ...rows[rows.length - 1].slice(1)]]);
    const stepped = uPlot.paths.stepped({ align: 1 });
    // The time panels share one span (the world size's, reaching the present), so that a
    // mark and the rate at that moment line up.
    const progress = [["steps_per_second", "steps/s", chart.rates, 1],
                      ["samples_per_second", "samples/s", chart.samples || [], 3]];
    const times = [...upToNow(chart.sizes), ...chart.rates, ...(chart.samples || [])]
      .map((row) => row[0]);
    span = times.length ? [Math.min(...times), Math.max(...times)] : null;
    // uPlot keeps the options a chart was made with: the range reads the latest span.
    const time = { x: { time: true, range: (_u, lo, hi) => (span && span[1] > span[0] ? span : [lo, hi]) } };
    const fromZero = { range: (_u, _lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] };
    if (chart.sizes.length >= 1) {
      const line = { paths: stepped, points: { show: false } };
      const world = { ...line, label: "world size", stroke: colors.series[0], width: 2 };
      const names = chart.machines || [];
      let shape = "1", data, series = [world], bands = [];
      if (names.length > 1 && (chart.by_machine || []).length > 0) {
        [shape, data, series, bands] = [names.join("\n"),
          ...machineBands(upToNow(chart.by_machine), names, line, world)];
      } else {
        const rows = upToNow(chart.sizes);
        const several = rows.some((r) => r[2] > 1);
        if (several) {
          series.push({ ...line, label: "machines", stroke: colors.series[2], dash: [4, 3] });
        }
        [shape, data] = [several ? "2" : "1", columns(rows, several ? 3 : 2)];
      }
      show("world_size", "world size", shape, data,
           { scales: { ...time, y: { range: (_u, _lo, hi) => [0, Math.max(1, hi) + 0.5] } },
             series: [{ label: "time" }, ...series], bands, axes: axes({ counts: true }),
             hooks: { draw: [drawMarks] } });
      keep.add("world_size");
    }
    for (const [name, unit, rates, color] of progress) {
      if (rates.length < 1 || compact) continue;
      show(name, `${unit} between commits`, "1", columns(rates, 2),
           { scales: { ...time, y: fromZero }, axes: axes(),
             series: [{ label: "time" }, { label: unit, stroke: colors.series[color], width: 1.5 }] });
      keep.add(name);
    }
    for (const [name, points] of Object.entries(chart.metrics || {})) {
      const ranks = [...new Set(points.map((p) => p[2]))].sort((a, b) => a - b);
      // uPlot wants one x column: each rank's own steps, joined (a gap where it has none).
      const tables = ranks.map((rank) => {
        const mine = points.filter((p) => p[2] === rank);
        return [mine.map((p) => p[0]), mine.map((p) => p[1])];
      });
      const data = uPlot.join(tables);
      const series = [{ label: "step" }, ...ranks.map((rank, i) => ({
        label: ranks.length > 1 ? `${name} (rank ${rank})` : name,
        stroke: colors.series[i % colors.series.length], width: 1.5, spanGaps: true,
      }))];
      show(`metric:${name}`, name, ranks.join(","), data,
           { scales: { x: { time: false } }, series, axes: axes({ xLabel: "step" }) },
           { synced: false }); // its x is steps, not time
      keep.add(`metric:${name}`);
    }
    drop(keep);
    box.hidden = plots.size === 0;
  }

  const resized = new ResizeObserver(() => {
    for (const { plot } of plots.values()) plot.setSize({ width: width(), height });
  });
  resized.observe(box);

  function destroy() {
    resized.disconnect();
    drop(new Set());
  }

  return { update, destroy };
}
