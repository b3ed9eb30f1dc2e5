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
// build, docs_tools/sandbox_site.py) and the spec from ./spec.zip.

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

async function start() {
  const t0 = performance.now();
  const py = await loadPyodide({
    indexURL: new URL("./pyodide/", import.meta.url).href,
    stdout: () => {}, // the start-up banner, if any
  });
  py.setStdout({ batched: (line) => forward(line + "\n") });
  py.setStderr({ batched: (line) => forward(line + "\n") });
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
