// The sandbox page's Python: Pyodide (CPython compiled to WebAssembly) in a Web Worker, so
// that a cell that never ends blocks only this worker, which the page can end and replace.
//
// Messages in:  {id, code}               run a cell (one at a time, in the order sent)
// Messages out: {type: "ready", python, pyodide, seconds}   loaded; the cells can run
//               {type: "failed", error}                     could not load
//               {type: "out", id, text}                     what the running cell printed
//               {type: "done", id, error, pictures}         the cell finished (see paged_spec/cells.py)
//
// Everything comes from this site: the runtime from ./pyodide/ (copied in by the docs
// build, docs_tools/sandbox_site.py) and the spec from ./spec.zip; packages too, were a
// cell to ask Pyodide for one (packageBaseUrl: no package server elsewhere is asked).
//
// What Python writes reaches the page as it is written, a line without its newline too:
// nothing is kept back here, so the end of a run (when Python flushes its own buffers)
// leaves nothing for the next cell. Standard input is at its end: there is no keyboard.

import { loadPyodide } from "./pyodide/pyodide.mjs";

const OUTPUT_LIMIT = 1 << 20; // characters of printed output forwarded per run
const FORWARD_MS = 50; // printed lines are sent in batches, at most this often

let current = null; // the id of the running cell
let pending = ""; // printed, not yet sent
let sent = 0; // characters sent for the running cell
let lastSend = 0;

function forward(text, force = false) {
  if (sent + pending.length < OUTPUT_LIMIT) {
    pending += text;
    if (sent + pending.length >= OUTPUT_LIMIT) {
      pending = pending.slice(0, OUTPUT_LIMIT - sent) + "\n[output cut at 1 MiB]\n";
    }
  }
  const now = performance.now();
  if (pending && (force || now - lastSend >= FORWARD_MS)) {
    postMessage({ type: "out", id: current, text: pending });
    sent += pending.length;
    pending = "";
    lastSend = now;
  }
}

/** A stream for Python's output: its bytes, decoded as they come, forwarded to the page. */
function writer() {
  const decoder = new TextDecoder(); // one per stream: a character may come in two writes
  return {
    write: (buffer) => {
      forward(decoder.decode(buffer, { stream: true }));
      return buffer.length;
    },
  };
}

async function start() {
  const t0 = performance.now();
  const here = new URL("./pyodide/", import.meta.url).href;
  const py = await loadPyodide({
    indexURL: here,
    packageBaseUrl: here,
    stdout: () => {}, // the start-up banner, if any
  });
  py.setStdout(writer());
  py.setStderr(writer());
  py.setStdin({ stdin: () => null }); // at its end: input() and sys.stdin.read() find nothing
  const zip = await fetch(new URL("./spec.zip", import.meta.url), { cache: "no-cache" });
  if (!zip.ok) throw new Error(`spec.zip: HTTP ${zip.status}`);
  py.unpackArchive(await zip.arrayBuffer(), "zip", { extractDir: "/home/pyodide/site" });
  py.runPython("import sys; sys.path.insert(0, '/home/pyodide/site')");
  const run = py.pyimport("paged_spec.cells").run_json;
  const python = py.runPython("import sys; sys.version.split()[0]");
  postMessage({ type: "ready", python, pyodide: py.version, seconds: (performance.now() - t0) / 1000 });
  return { py, run };
}

const ready = start();
ready.catch((e) => postMessage({ type: "failed", error: String(e) }));

onmessage = async (event) => {
  const { py, run } = await ready;
  const { id, code } = event.data;
  current = id;
  sent = 0;
  pending = "";
  let result;
  try {
    result = JSON.parse(run(code));
  } catch (e) {
    result = { error: String(e), pictures: [] }; // a failure of the runner itself
  }
  py.runPython("import sys; sys.stdout.flush(); sys.stderr.flush()");
  forward("", true);
  postMessage({ type: "done", id, ...result });
  current = null;
};
