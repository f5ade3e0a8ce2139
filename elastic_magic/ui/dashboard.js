// Live dashboard of one elastic job (anywidget). State comes from the kernel a few times a
// second; the only messages back are commands ({command: "stop"}, "scale", "stacks"), which
// the kernel queues for the agent. `uPlot` and `liveCharts` come before this file in the
// widget's module (ui/dashboard.py's widget_module), and with them `two` and `clockAt`, the
// one time-of-day format.

const h = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  node.append(...children);
  return node;
};

const FINAL = new Set(["succeeded", "failed", "stopped"]);

// The one length-of-time format (ui/describe.py's duration): 4.2s, 2m 05s, 1h 02m.
function duration(seconds) {
  const s = Math.max(0, seconds);
  if (s < 60) return `${s.toFixed(1)}s`;
  const whole = Math.floor(s);
  if (whole < 3600) return `${Math.floor(whole / 60)}m ${two(whole % 60)}s`;
  return `${Math.floor(whole / 3600)}h ${two(Math.floor((whole % 3600) / 60))}m`;
}

const countOf = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;

function elapsed(header) {
  if (!header.started_at) return "-";
  const end = header.finished_at ?? Date.now() / 1000;
  return duration(end - header.started_at);
}

// A line's text, or where it had colours, its styled runs ([[css, text], ...]) as the
// kernel parsed them (ui/ansi.py, the one parser): text only ever as text, never as HTML.
const styled = (text, runs) => (runs ? runs.map(([css, part]) =>
  (css ? h("span", { style: css }, part) : part)) : [text]);

function render({ model, el }) {
  el.classList.add("em-dash");
  let active = "all";
  let stopping = false;
  let gathering = false; // stacks asked for, not arrived yet

  const badge = h("span", { class: "em-badge", "data-em": "state" });
  const stats = h("span", { class: "em-stats" });
  const clock = h("span", { class: "em-clock", "data-em": "elapsed" });
  const stop = h("button", { class: "em-stop", "data-em": "stop" }, "Stop");
  const stacksButton = h("button", { class: "em-stacks-button", "data-em": "stacks-button",
                                     title: "every rank's Python stacks, without stopping it" },
                         "Stacks");
  const scaleInput = h("input", { type: "number", class: "em-scale-input", "data-em": "scale-input",
                                  title: "workers on this machine" });
  const scaleButton = h("button", { class: "em-scale-button", "data-em": "scale-button" }, "Resize");
  const scaleLabel = h("span", { class: "em-scale-label", "data-em": "scale-label" });
  const scaleSlot = h("span", { class: "em-scale", "data-em": "scale" }, scaleLabel, scaleInput, scaleButton);
  let typed = false; // a size typed in the box stays until it is sent
  scaleInput.addEventListener("input", () => { typed = true; });
  const join = h("div", { class: "em-join", "data-em": "join", hidden: "" });
  const earlier = h("div", { class: "em-earlier", "data-em": "earlier" });
  const commitLine = h("div", { class: "em-commit", "data-em": "commit" });
  const scaleError = h("div", { class: "em-scale-error", "data-em": "scale-error" });
  const header = h("div", { class: "em-header" }, badge, stats, clock,
                   h("span", { class: "em-controls" }, scaleSlot, stacksButton, stop));
  const failure = h("div", { class: "em-failure", "data-em": "failure" });
  const stacks = h("details", { class: "em-stacks", "data-em": "stacks", open: "" });
  const tabs = h("div", { class: "em-tabs", role: "tablist" });
  const note = h("div", { class: "em-note", "data-em": "note" });
  const pane = h("pre", { class: "em-lines", "data-em": "lines" });
  const timeline = h("ol", { class: "em-timeline", "data-em": "timeline" });
  const details = h("details", { class: "em-timeline-box" },
                    h("summary", {}, "Timeline"), timeline);
  const chartBox = h("div", { class: "em-charts", "data-em": "charts" });
  const chartsShown = h("details", { class: "em-charts-box", "data-em": "charts-box", open: "" },
                        h("summary", {}, "Charts"), chartBox);
  const charts = liveCharts(uPlot, chartBox);
  el.append(header, join, commitLine, scaleError, failure, stacks, chartsShown, tabs, note, pane,
            earlier, details);
  scaleButton.addEventListener("click", () => {
    typed = false;
    model.send({ command: "scale", nproc: Number(scaleInput.value) });
  });

  stacksButton.addEventListener("click", () => {
    gathering = true;
    model.send({ command: "stacks" });
    drawHeader();
  });

  // Commands are idempotent; resend until the job reacts, in case one was queued behind
  // the running cell (a kernel without subshells, or a message routed to the main shell).
  let resend = null;
  stop.addEventListener("click", () => {
    stopping = true;
    model.send({ command: "stop" });
    resend = resend ?? setInterval(() => {
      if (FINAL.has(model.get("header").state)) clearInterval(resend);
      else model.send({ command: "stop" });
    }, 2000);
    drawHeader();
  });

  function drawHeader() {
    const hd = model.get("header");
    badge.textContent = hd.state;
    badge.dataset.state = hd.state;
    const machines = countOf(hd.nnodes, "machine"); // the Elastic jobs panel's word
    stats.replaceChildren(
      h("span", { "data-em": "world-size" }, `world size ${hd.world_size}`),
      ` · ${machines} · `,
      h("span", { "data-em": "restarts" }, `restarts ${hd.restarts}/${hd.max_restarts}`),
      ` · round ${hd.round}`,
    );
    clock.textContent = elapsed(hd);
    const controls = model.get("controls");
    const canStop = controls.stop && !FINAL.has(hd.state);
    stop.disabled = !canStop || stopping;
    stop.textContent = stopping && !FINAL.has(hd.state) ? "Stopping…" : "Stop";
    const bounds = controls.scale;
    scaleSlot.hidden = !bounds || bounds.min === bounds.max;
    if (bounds) {
      scaleInput.min = bounds.min;
      scaleInput.max = bounds.max;
      // The box shows this machine's workers now (not the bounds' minimum), until typed in.
      if (!typed && hd.nproc) scaleInput.value = hd.nproc;
      scaleLabel.textContent = hd.nnodes > 1 ? "workers here" : "workers";
    }
    scaleInput.disabled = scaleButton.disabled = FINAL.has(hd.state);
    stacksButton.hidden = !controls.stacks;
    stacksButton.disabled = gathering || FINAL.has(hd.state);
    stacksButton.textContent = gathering ? "Gathering…" : "Stacks";
    scaleError.textContent = controls.error || "";
    const parts = [];
    if (hd.pending_resize) parts.push(`resize to ${countOf(hd.pending_resize, "worker")} pending`);
    const c = hd.last_commit;
    if (c) parts.push(`last commit: step ${c.step} at world size ${c.world_size}, ${clockAt(c.time)}`);
    commitLine.textContent = parts.join(" · ");
    commitLine.hidden = parts.length === 0;
    drawJoin(hd.join_command);
  }

  // A multi-node job's join command, at the top, with a copy button.
  let joinShown = null;
  function drawJoin(command) {
    join.hidden = !command;
    if (!command || command === joinShown) return;
    joinShown = command;
    const copy = h("button", { class: "em-copy", "data-em": "join-copy" }, "Copy");
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(command);
        copy.textContent = "Copied";
      } catch {
        copy.textContent = "Select and copy";
      }
    });
    join.replaceChildren("Other machines join with: ",
                         h("code", { "data-em": "join-command" }, command), " ", copy);
  }

  // Groups before a restart or a resize: their output stays reachable, collapsed.
  function drawEarlier() {
    earlier.replaceChildren(...(model.get("earlier") || []).map((e) => {
      const ranks = Object.entries(e.lines).flatMap(([rank, lines]) => [
        h("div", { class: "em-stacks-rank" }, `Rank ${rank}`),
        h("pre", { class: "em-lines" }, ...lines.map(([stream, text, runs]) =>
          h("span", { class: `em-${stream}` }, ...styled(text, runs), "\n"))),
      ]);
      return h("details", { class: "em-earlier-group", "data-em": "earlier-group" },
               h("summary", {}, `Earlier group (restarts ${e.restart}): ${e.why}`), ...ranks);
    }));
  }

  function drawFailure() {
    const f = model.get("failure");
    if (!f || f.rank === undefined) {
      failure.replaceChildren();
      failure.hidden = true;
      return;
    }
    failure.hidden = false;
    const others = (f.others || []).map((o) =>
      h("div", {}, `Rank${o.ranks.length > 1 ? "s" : ""} ${o.ranks.join(", ")} also failed: ${o.text}`));
    const consequences = (f.consequences || []).map((c) =>
      h("div", { class: "em-consequence" }, `Rank ${c.rank}: ${c.text}`));
    failure.replaceChildren(
      h("div", { class: "em-failure-title" }, `Root cause: rank ${f.rank} (${f.attempt_label || ""}): ${f.headline}`),
      h("pre", {}, f.traceback || ""),
      ...others,
      ...consequences,
    );
  }

  function drawStacks() {
    const s = model.get("stacks") || {};
    gathering = false;
    drawHeader();
    const ranks = Object.entries(s.ranks || {});
    stacks.hidden = !s.title;
    if (!s.title) { stacks.replaceChildren(); return; }
    const body = ranks.length ? ranks.flatMap(([rank, text]) => [
      h("div", { class: "em-stacks-rank" }, `Rank ${rank}`),
      h("pre", { "data-em": `stacks-${rank}` }, text),
    ]) : [h("div", {}, "no rank is running")];
    stacks.replaceChildren(h("summary", {}, s.title), ...body);
  }

  function drawTabs() {
    const ranks = model.get("ranks");
    if (active !== "all" && !ranks.includes(Number(active))) active = "all";
    const make = (key, label) => {
      const tab = h("button", { class: "em-tab", role: "tab", "data-em": `tab-${key}` }, label);
      if (String(active) === String(key)) tab.classList.add("em-active");
      tab.addEventListener("click", () => { active = key; drawTabs(); drawLines(); });
      return tab;
    };
    tabs.replaceChildren(make("all", "All ranks"), ...ranks.map((r) => make(String(r), `Rank ${r}`)));
  }

  function drawLines() {
    const atBottom = pane.scrollHeight - pane.scrollTop - pane.clientHeight < 24;
    const rows = [];
    if (active === "all") {
      for (const [rank, stream, text, runs] of model.get("merged")) {
        rows.push(h("span", { class: `em-${stream}` }, h("span", { class: "em-prefix" }, `[${rank}] `),
                    ...styled(text, runs), "\n"));
      }
      note.textContent = "";
    } else {
      for (const [stream, text, runs] of model.get("lines")[active] || []) {
        rows.push(h("span", { class: `em-${stream}` }, ...styled(text, runs), "\n"));
      }
      const hidden = model.get("hidden")[active] || 0;
      const log = (model.get("logs")[active] || {}).stdout || "";
      note.textContent = hidden ? `${hidden} earlier lines not shown · full log: ${log}` : `full log: ${log}`;
    }
    pane.replaceChildren(...rows);
    if (atBottom) pane.scrollTop = pane.scrollHeight;
  }

  function drawTimeline() {
    timeline.replaceChildren(...model.get("timeline").map((e) =>
      h("li", { "data-kind": e.kind },
        h("span", { class: "em-time" }, clockAt(e.time)),
        ` ${e.text}`)));
  }

  function drawCharts() {
    const chart = model.get("charts");
    charts.update(chart);
    chartsShown.hidden = !chart || chart.sizes === undefined || chartBox.hidden;
  }

  function drawAll() {
    drawHeader(); drawFailure(); drawStacks(); drawCharts(); drawTabs(); drawLines(); drawEarlier();
    drawTimeline();
  }
  model.on("change:earlier", drawEarlier);
  model.on("change:header", drawHeader);
  model.on("change:controls", drawHeader);
  model.on("change:failure", drawFailure);
  model.on("change:stacks", drawStacks);
  model.on("change:ranks", () => { drawTabs(); drawLines(); });
  model.on("change:lines", drawLines);
  model.on("change:merged", drawLines);
  model.on("change:timeline", drawTimeline);
  model.on("change:charts", drawCharts);
  drawAll();
  let ticks = 0;
  const timer = setInterval(() => {
    clock.textContent = elapsed(model.get("header"));
    // A running job's lines reach the present even while nothing happens.
    if (++ticks % 4 === 0 && !FINAL.has(model.get("header").state)) drawCharts();
  }, 500);
  return () => { clearInterval(timer); if (resend) clearInterval(resend); charts.destroy(); };
}

export default { render };
