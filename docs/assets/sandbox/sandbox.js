// The sandbox page's cells: each code block inside a <div class="sandbox-cell"> becomes an
// editor with Run, Stop and Reset, the output it printed, and the picture its show() drew.
//
// Python runs in one Web Worker (worker.js), one cell at a time, in the order Run was
// pressed. Stop ends the worker (the only way to stop Python that needs no special
// server headers) and starts a fresh one; cells waiting their turn run on the new one.
// Each cell's <div> carries its state for readers and tests alike: data-state is
// loading, idle, queued, running, done, error, stopped or unavailable, and data-runs counts the
// runs that came to an end.

const style = document.createElement("link");
style.rel = "stylesheet";
style.href = new URL("./sandbox.css", import.meta.url).href;
document.head.append(style);

const page = document.querySelector("#sandbox-status");
const cells = [...document.querySelectorAll(".sandbox-cell")].map(makeCell);
const OUTPUT_SHOWN = 200_000; // characters kept in an output box; earlier ones are dropped

let worker = null;
let ready = false;
let running = null; // the cell whose code the worker is running
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
      ready = true;
      page.dataset.loadSeconds = msg.seconds.toFixed(2);
      status(
        "ready",
        `Python ${msg.python} (Pyodide ${msg.pyodide}) is running in this page; ` +
          `it loaded in ${msg.seconds.toFixed(1)} s. Edit a cell, then Run (or Shift+Enter).`,
      );
      for (const cell of cells) if (cell.root.dataset.state === "loading") setState(cell, "idle");
      next();
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
  editor.value = original;
  editor.rows = original.split("\n").length;
  editor.setAttribute("aria-label", "Python code of this cell");
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
  block.replaceWith(editor);
  root.append(bar, output, picture);
  const cell = { root, editor, run, stop, reset, note, output, picture, text: "" };
  run.onclick = () => submit(cell);
  stop.onclick = () => stopCell(cell);
  reset.onclick = () => {
    editor.value = original;
    editor.rows = original.split("\n").length;
  };
  editor.addEventListener("keydown", (e) => onKey(cell, e));
  editor.addEventListener("input", () => {
    editor.rows = Math.max(editor.value.split("\n").length, 1);
  });
  root.dataset.runs = "0";
  setState(cell, "loading");
  return cell;
}

function button(label, cls) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = `md-button ${cls}`;
  b.textContent = label;
  return b;
}

function onKey(cell, e) {
  if (e.key === "Enter" && (e.shiftKey || e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    submit(cell);
  } else if (e.key === "Tab" && !e.shiftKey) {
    e.preventDefault(); // indent by four spaces instead of leaving the editor
    e.target.setRangeText("    ", e.target.selectionStart, e.target.selectionEnd, "end");
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
  running.text = "";
  running.output.textContent = "";
  running.output.classList.remove("sandbox-failed");
  setState(running, "running");
  running.started = performance.now();
  worker.postMessage({ id: running.root.dataset.cell, code: running.editor.value });
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
      cell.output.textContent = cell.text;
    });
  }
}

function finish(cell, result) {
  running = null;
  cell.output.textContent = cell.text;
  if (result.error) {
    const err = document.createElement("span");
    err.className = "sandbox-error";
    err.textContent = result.error + "\n";
    cell.output.append(err);
  }
  cell.picture.innerHTML = result.pictures.join("\n"); // SVG drawn by paged_spec/svg.py
  cell.root.pictures = result.pictures; // as Python drew them, for a test to compare
  const seconds = ((performance.now() - cell.started) / 1000).toFixed(2);
  cell.root.dataset.seconds = seconds;
  cell.root.dataset.runs = String(Number(cell.root.dataset.runs) + 1);
  setState(cell, result.error ? "error" : "done");
  next();
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
  running = null;
  cell.output.textContent = cell.text;
  cell.root.dataset.runs = String(Number(cell.root.dataset.runs) + 1);
  setState(cell, "stopped");
  status("loading", "Restarting Python after Stop...");
  startWorker();
}

status("loading", "Loading Python (Pyodide) from this site...");
startWorker();
