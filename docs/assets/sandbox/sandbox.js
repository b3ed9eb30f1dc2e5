// The sandbox page's cells: each code block inside a <div class="sandbox-cell"> becomes an
// editor with Run, Stop and Reset, the output it printed, and the picture its show() drew.
//
// Python runs in one Web Worker (worker.js), one cell at a time, in the order Run was
// pressed. Stop ends the worker (the only way to stop Python that needs no special
// server headers) and starts a fresh one; cells waiting their turn run on the new one.
// What a cell shows is always its last run's: Run clears the output and the picture at
// once, Stop leaves what was printed and no picture, Reset clears both with the code.
// Each cell's <div> carries its state for readers and tests alike: data-state is
// loading, idle, queued, running, done, error, stopped or unavailable, data-runs counts the
// runs that came to an end, data-seconds is the last one's time from Run to its end (or
// to Stop); the status line's data-restart-seconds is the time from the last Stop to a
// fresh Python ready.

import { highlight } from "./highlight.js";

const style = document.createElement("link");
style.rel = "stylesheet";
style.href = new URL("./sandbox.css", import.meta.url).href;
style.addEventListener("load", () => cells.forEach(fit)); // its sizes change the editors'
document.head.append(style);
addEventListener("resize", () => cells.forEach(fit));

const page = document.querySelector("#sandbox-status");
const cells = [...document.querySelectorAll(".sandbox-cell")].map(makeCell);
const OUTPUT_SHOWN = 200_000; // characters kept in an output box; earlier ones are dropped

let worker = null;
let ready = false;
let running = null; // the cell whose code the worker is running
let stoppedAt = null; // when Stop ended the last worker, until the next one is ready
const queue = []; // cells waiting for the worker

function status(state, text) {
  page.dataset.state = state;
  page.textContent = text;
}

function startWorker() {
  ready = false;
  const me = new Worker(new URL("./worker.js", import.meta.url), { type: "module" });
  worker = me;
  me.onmessage = (event) => {
    if (worker !== me) return; // a message from a worker that was stopped
    const msg = event.data;
    if (msg.type === "ready") {
      onReady(msg);
    } else if (msg.type === "failed") {
      failed(`Python could not start in this page: ${msg.error}`);
    } else if (msg.type === "out" && running) {
      append(running, msg.text);
    } else if (msg.type === "done" && running) {
      finish(running, msg);
    }
  };
  me.onerror = (event) => failed(`Python's worker failed: ${event.message || "(no message)"}`);
}

function onReady(msg) {
  ready = true;
  page.dataset.loadSeconds = msg.seconds.toFixed(2);
  let again = "";
  if (stoppedAt !== null) {
    const seconds = (performance.now() - stoppedAt) / 1000;
    page.dataset.restartSeconds = seconds.toFixed(2);
    again = ` It restarted ${seconds.toFixed(1)} s after Stop.`;
    stoppedAt = null;
  }
  status(
    "ready",
    `Python ${msg.python} (Pyodide ${msg.pyodide}) is running in this page; ` +
      `it loaded in ${msg.seconds.toFixed(1)} s.${again} Edit a cell, then Run (or Shift+Enter).`,
  );
  for (const cell of cells) if (cell.root.dataset.state === "loading") setState(cell, "idle");
  next();
}

function failed(text) {
  status("failed", text);
  for (const cell of cells) {
    if (["loading", "queued", "running"].includes(cell.root.dataset.state)) {
      setState(cell, "unavailable");
    }
  }
  queue.length = 0;
  running = null;
}

function makeCell(root) {
  const block = root.querySelector("div.highlight, pre");
  const original = root.querySelector("pre code, pre").textContent.replace(/\n+$/, "");
  const editor = document.createElement("textarea");
  editor.className = "sandbox-editor";
  editor.spellcheck = false;
  editor.wrap = "off";
  editor.value = original;
  editor.rows = original.split("\n").length;
  editor.setAttribute("aria-label", "Python code of this cell");
  // The coloured code, under the editor's text: a <pre> of spans with no <code>, which the
  // theme would give a copy button that cannot be reached under the editor.
  const layer = document.createElement("div");
  layer.className = "sandbox-layer highlight";
  layer.setAttribute("aria-hidden", "true");
  layer.append(document.createElement("pre"));
  const code = document.createElement("div");
  code.className = "sandbox-code";
  code.append(layer, editor);
  const bar = document.createElement("div");
  bar.className = "sandbox-bar";
  const run = button("Run", "sandbox-run");
  const stop = button("Stop", "sandbox-stop");
  const reset = button("Reset", "sandbox-reset");
  const note = document.createElement("span");
  note.className = "sandbox-note";
  bar.append(run, stop, reset, note);
  const output = document.createElement("pre");
  output.className = "sandbox-output";
  const picture = document.createElement("div");
  picture.className = "sandbox-picture";
  block.replaceWith(code);
  root.append(bar, output, picture);
  const cell = { root, editor, layer, run, stop, reset, note, output, picture, text: "", error: "" };
  run.onclick = () => submit(cell);
  stop.onclick = () => stopCell(cell);
  reset.onclick = () => resetCell(cell, original);
  editor.addEventListener("keydown", (e) => onKey(cell, e));
  editor.addEventListener("input", () => colour(cell));
  editor.addEventListener("scroll", () => follow(cell));
  root.dataset.runs = "0";
  setState(cell, "loading");
  colour(cell);
  return cell;
}

function button(label, cls) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = `md-button ${cls}`;
  b.textContent = label;
  return b;
}

/** Colour the editor's code again (tests/test_sandbox_page.py compares it with Pygments). */
function colour(cell) {
  cell.layer.firstChild.replaceChildren(
    ...highlight(cell.editor.value).map(([cls, text]) => {
      if (!cls) return document.createTextNode(text);
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      return span;
    }),
  );
  fit(cell);
}

/** The editor as tall as its code (no scroll bar of its own but a sideways one). */
function fit(cell) {
  const e = cell.editor;
  e.style.height = "auto";
  e.style.height = `${e.scrollHeight + e.offsetHeight - e.clientHeight}px`;
  follow(cell);
}

/** The coloured code scrolls with the editor's. */
function follow(cell) {
  cell.layer.scrollLeft = cell.editor.scrollLeft;
  cell.layer.scrollTop = cell.editor.scrollTop;
}

function onKey(cell, e) {
  if (e.key === "Enter" && (e.shiftKey || e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    submit(cell);
  } else if (e.key === "Tab" && !e.shiftKey) {
    e.preventDefault(); // indent by four spaces instead of leaving the editor
    e.target.setRangeText("    ", e.target.selectionStart, e.target.selectionEnd, "end");
    colour(cell);
  }
}

function setState(cell, state) {
  cell.root.dataset.state = state;
  cell.stop.disabled = !(state === "running" || state === "queued");
  cell.run.disabled = ["running", "queued", "unavailable"].includes(state);
  const notes = {
    loading: "Python is loading...",
    queued: "waiting its turn",
    running: "running... (Stop ends it)",
    stopped: "stopped: Python was restarted",
    error: "raised an exception (below)",
    unavailable: "Python is not available (see the top of the page)",
  };
  cell.note.textContent = notes[state] || "";
}

function submit(cell) {
  if (running === cell || queue.includes(cell)) return;
  queue.push(cell);
  setState(cell, "queued");
  next();
}

function next() {
  if (!ready || running || queue.length === 0) return;
  running = queue.shift();
  clear(running);
  setState(running, "running");
  running.started = performance.now();
  worker.postMessage({ id: running.root.dataset.cell, code: running.editor.value });
}

/** Nothing under the cell: no output, no error, no picture. */
function clear(cell) {
  cell.text = "";
  cell.error = "";
  render(cell);
  cell.picture.replaceChildren();
  cell.root.pictures = [];
}

function append(cell, text) {
  cell.text += text;
  if (cell.text.length > OUTPUT_SHOWN) {
    cell.text = "[earlier output dropped]\n" + cell.text.slice(-OUTPUT_SHOWN);
  }
  if (!cell.drawing) {
    cell.drawing = true; // redraw at most once a frame, however fast the lines come
    requestAnimationFrame(() => {
      cell.drawing = false;
      render(cell);
    });
  }
}

/** Show the cell's output and its error: the one place that writes the output box, so a
 * redraw that comes late shows the error too. */
function render(cell) {
  cell.output.textContent = cell.text;
  if (cell.error) {
    const err = document.createElement("span");
    err.className = "sandbox-error";
    err.textContent = cell.error + "\n";
    cell.output.append(err);
  }
}

function finish(cell, result) {
  running = null;
  cell.error = result.error;
  render(cell);
  cell.picture.innerHTML = result.pictures.join("\n"); // SVG drawn by paged_spec/svg.py
  cell.root.pictures = result.pictures; // as Python drew them, for a test to compare
  ended(cell, result.error ? "error" : "done");
  next();
}

/** A run came to an end: its time, its count, its state. */
function ended(cell, state) {
  cell.root.dataset.seconds = ((performance.now() - cell.started) / 1000).toFixed(2);
  cell.root.dataset.runs = String(Number(cell.root.dataset.runs) + 1);
  setState(cell, state);
}

function stopCell(cell) {
  const at = queue.indexOf(cell);
  if (at >= 0) {
    queue.splice(at, 1);
    setState(cell, "idle");
    return;
  }
  if (running !== cell) return;
  worker.terminate();
  stoppedAt = performance.now();
  running = null;
  render(cell);
  ended(cell, "stopped");
  status("loading", "Restarting Python after Stop...");
  startWorker();
}

function resetCell(cell, original) {
  stopCell(cell); // a run of the code being replaced has nothing more to show
  cell.editor.value = original;
  colour(cell);
  clear(cell);
  if (["done", "error", "stopped"].includes(cell.root.dataset.state)) setState(cell, "idle");
}

status("loading", "Loading Python (Pyodide) from this site...");
startWorker();
