// The demo page: trains the demo CNN in the tab with trainops' JavaScript trainer on
// onnxruntime-web (served by `python -m trainops serve-demo` from npm's package, no CDN),
// draws the loss and test accuracy, predicts a drawn digit, downloads the checkpoint.
//
// URL: ?steps=N (default 300) &backend=wasm|webgpu (default: WebGPU when navigator.gpu
// gives an adapter, else WASM). Progress for tests: window.trainopsDemo =
// {steps, losses, accuracies, backend, done, error}.
import * as ort from "/ort/ort.all.min.mjs";
import { Trainer } from "/js/src/index.js";
import { argmax, feeds, loadData, train } from "./demo.js";

const params = new URLSearchParams(location.search);
const target = Math.max(1, Number.parseInt(params.get("steps") ?? "300", 10) || 300);
const demo = { steps: 0, losses: [], accuracies: [], backend: null, done: false, error: null,
               target };
window.trainopsDemo = demo;

const $ = (id) => document.getElementById(id);
const status = (text) => { $("status").textContent = text; };

// One trainer call at a time: a training step, an evaluation and a prediction never overlap.
let queue = Promise.resolve();
const exclusive = (fn) => (queue = queue.then(fn, fn));

async function pickBackend(wanted) {
  let adapter = null;
  if (wanted !== "wasm" && navigator.gpu) {
    try { adapter = await navigator.gpu.requestAdapter(); } catch { adapter = null; }
  }
  if (wanted === "webgpu" && !adapter) {
    return { backend: "wasm", note: "no WebGPU adapter in this browser: WASM instead" };
  }
  return { backend: adapter ? "webgpu" : "wasm", note: "" };
}

// --- the chart ---------------------------------------------------------------------------

function drawChart() {
  const c = $("chart");
  const g = c.getContext("2d");
  const W = c.width, H = c.height, L = 48, R = 44, T = 14, B = 30;
  g.clearRect(0, 0, W, H);
  g.font = "12px system-ui, sans-serif";
  const n = Math.max(demo.target, demo.losses.length, 2);
  const top = Math.max(2.5, ...demo.losses.slice(0, 5)) * 1.05;
  const x = (s) => L + ((s - 1) / (n - 1)) * (W - L - R);
  const yl = (v) => T + (1 - Math.min(v, top) / top) * (H - T - B);
  const ya = (a) => T + (1 - a) * (H - T - B);
  g.strokeStyle = "#e9ecef";
  g.fillStyle = "#5b6475";
  for (let k = 0; k <= 4; k++) {
    const y = T + (k / 4) * (H - T - B);
    g.beginPath(); g.moveTo(L, y); g.lineTo(W - R, y); g.stroke();
    g.textAlign = "right"; g.fillText((top * (1 - k / 4)).toFixed(2), L - 6, y + 4);
    g.textAlign = "left"; g.fillText(`${100 - k * 25}%`, W - R + 6, y + 4);
  }
  g.textAlign = "center";
  g.fillText(`step (of ${n})`, (L + W - R) / 2, H - 8);
  g.fillStyle = "#d9480f"; g.textAlign = "left"; g.fillText("loss", L + 6, T + 12);
  g.fillStyle = "#1971c2"; g.fillText("test accuracy", L + 50, T + 12);
  g.lineWidth = 1.5;
  g.strokeStyle = "#d9480f";
  g.beginPath();
  demo.losses.forEach((v, i) => (i ? g.lineTo(x(i + 1), yl(v)) : g.moveTo(x(1), yl(v))));
  g.stroke();
  g.strokeStyle = "#1971c2";
  g.fillStyle = "#1971c2";
  g.beginPath();
  demo.accuracies.forEach(([s, a], i) => (i ? g.lineTo(x(s), ya(a)) : g.moveTo(x(s), ya(a))));
  g.stroke();
  for (const [s, a] of demo.accuracies) { g.beginPath(); g.arc(x(s), ya(a), 2.5, 0, 7); g.fill(); }
}

// --- drawing a digit ---------------------------------------------------------------------

const pad = $("pad");
const pen = pad.getContext("2d");
let drawn = false;

function clearPad() {
  pen.fillStyle = "#000"; pen.fillRect(0, 0, pad.width, pad.height);
  drawn = false;
  $("guess").textContent = "–"; $("bars").replaceChildren();
  $("seen").getContext("2d").clearRect(0, 0, 80, 80);
}

function padImages() {
  // The ink's bounding box, widened to the glyphs' 5:7, averaged into 5x7 cells, placed in
  // an 8x8 image at every offset the training digits have (rows 0-1, columns 0-3).
  const { data } = pen.getImageData(0, 0, pad.width, pad.height);
  let x0 = pad.width, y0 = pad.height, x1 = -1, y1 = -1;
  for (let y = 0; y < pad.height; y++) {
    for (let x = 0; x < pad.width; x++) {
      if (data[(y * pad.width + x) * 4] > 40) {
        x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y);
      }
    }
  }
  if (x1 < 0) return null;
  let w = x1 - x0 + 1, h = y1 - y0 + 1;
  if (w * 7 < h * 5) { const nw = (h * 5) / 7; x0 -= (nw - w) / 2; w = nw; } else { const nh = (w * 7) / 5; y0 -= (nh - h) / 2; h = nh; }
  const cells = new Float32Array(35);
  for (let r = 0; r < 7; r++) {
    for (let c = 0; c < 5; c++) {
      let sum = 0, count = 0;
      for (let y = Math.floor(y0 + (r * h) / 7); y < y0 + ((r + 1) * h) / 7; y++) {
        for (let x = Math.floor(x0 + (c * w) / 5); x < x0 + ((c + 1) * w) / 5; x++) {
          count++;
          if (x >= 0 && y >= 0 && x < pad.width && y < pad.height) sum += data[(y * pad.width + x) * 4] / 255;
        }
      }
      cells[r * 5 + c] = Math.min(1, (1.8 * sum) / Math.max(count, 1));
    }
  }
  const images = new Float32Array(8 * 64).fill(-0.3); // the training digits' background
  let k = 0;
  for (let dy = 0; dy < 2; dy++) {
    for (let dx = 0; dx < 4; dx++, k++) {
      for (let r = 0; r < 7; r++) for (let c = 0; c < 5; c++) images[k * 64 + (dy + r) * 8 + dx + c] += cells[r * 5 + c];
    }
  }
  const seen = $("seen").getContext("2d");
  for (let i = 0; i < 64; i++) {
    const v = Math.round(255 * Math.max(0, Math.min(1, images[64 + i] + 0.3)));
    seen.fillStyle = `rgb(${v},${v},${v})`;
    seen.fillRect((i % 8) * 10, Math.floor(i / 8) * 10, 10, 10);
  }
  return images;
}

async function predict(trainer, data) {
  if (!drawn || !trainer) return;
  const images = padImages();
  if (!images) return;
  const out = await trainer.eval(feeds(ort, data, images)); // one at a time (main)
  const logits = out.logits.data;
  const p = new Float64Array(10);
  for (let k = 0; k < 8; k++) { // the mean softmax over the eight placements
    const row = logits.slice(k * 10, k * 10 + 10);
    const m = Math.max(...row);
    const e = row.map((v) => Math.exp(v - m));
    const s = e.reduce((a, b) => a + b, 0);
    e.forEach((v, j) => { p[j] += v / s / 8; });
  }
  const best = argmax({ dims: [1, 10], data: p })[0];
  $("guess").replaceChildren(String(best), Object.assign(document.createElement("span"),
    { className: "small", textContent: ` ${(100 * p[best]).toFixed(0)}%` }));
  $("bars").replaceChildren(...[...p].flatMap((v, j) => {
    const label = document.createElement("span"); label.textContent = j;
    const bar = document.createElement("span"); bar.className = "bar";
    bar.style.width = `${Math.max(1, 100 * v)}%`;
    return [label, bar];
  }));
}

// --- the run -----------------------------------------------------------------------------

let stopping = false;
const yieldToPage = () => new Promise((r) => setTimeout(r, 0));

async function run(state, steps) {
  stopping = false;
  $("stop").disabled = false; $("more").disabled = true;
  const t0 = performance.now();
  const first = demo.losses.length + 1;
  await train({
    ort, Trainer, base: new URL("/", location.href), steps, every: 25, first,
    trainer: state.trainer, data: state.data, executionProviders: state.providers,
    shouldStop: () => stopping,
    onStep: async (step, loss) => {
      demo.losses.push(loss); demo.steps = step;
      if (step % 5 === 0 || step === first + steps - 1) {
        const rate = (step - first + 1) / ((performance.now() - t0) / 1000);
        status(`step ${step}: loss ${loss.toFixed(4)} (${rate.toFixed(0)} steps/s, ${demo.backend})`);
        drawChart();
        await yieldToPage();
      }
    },
    onAccuracy: async (step, acc) => {
      demo.accuracies.push([step, acc]);
      drawChart();
      await predict(state.trainer, state.data);
    },
  }).then((r) => Object.assign(state, { trainer: r.trainer, data: r.data }));
  drawChart();
  const acc = demo.accuracies.at(-1);
  status(`${demo.steps} steps on ${demo.backend}: loss ${demo.losses[0].toFixed(3)} → ` +
         `${demo.losses.at(-1).toFixed(3)}, test accuracy ${acc ? (100 * acc[1]).toFixed(1) : "?"}%`);
  $("stop").disabled = true; $("more").disabled = false; $("download").disabled = false;
}

async function main() {
  clearPad();
  drawChart();
  const { backend, note } = await pickBackend(params.get("backend"));
  demo.backend = backend;
  $("backend").textContent = backend === "webgpu" ? "WebGPU" : "WASM";
  // One WASM thread: the run repeats bit for bit (and needs no cross-origin isolation).
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.wasmPaths = "/ort/";
  const providers = backend === "webgpu" ? ["webgpu", "wasm"] : ["wasm"];
  status(`${note ? note + "; " : ""}loading the artifacts…`);
  const state = {
    providers,
    data: await loadData(new URL("/data/", location.href)),
    trainer: await Trainer.fromArtifacts(new URL("/artifacts/", location.href).href,
                                         { ort, executionProviders: providers, intraOpNumThreads: 1 }),
  };
  // The trainer is used between steps too (predictions): every call goes through `exclusive`.
  const step = state.trainer.step.bind(state.trainer);
  const evaluate = state.trainer.eval.bind(state.trainer);
  state.trainer.step = (f) => exclusive(() => step(f));
  state.trainer.eval = (f) => exclusive(() => evaluate(f));

  let last = null;
  const at = (e) => { const r = pad.getBoundingClientRect(); return [(e.clientX - r.left) * pad.width / r.width, (e.clientY - r.top) * pad.height / r.height]; };
  pad.addEventListener("pointerdown", (e) => { pad.setPointerCapture(e.pointerId); last = at(e); });
  pad.addEventListener("pointermove", (e) => {
    if (!last) return;
    const p = at(e);
    pen.strokeStyle = "#fff"; pen.lineWidth = 20; pen.lineCap = "round";
    pen.beginPath(); pen.moveTo(...last); pen.lineTo(...p); pen.stroke();
    last = p; drawn = true;
  });
  pad.addEventListener("pointerup", () => { last = null; predict(state.trainer, state.data).catch(fail); });
  $("clear").addEventListener("click", clearPad);
  $("stop").addEventListener("click", () => { stopping = true; });
  $("more").addEventListener("click", () => run(state, 200).catch(fail));
  $("download").addEventListener("click", () => exclusive(async () => {
    if (state.trainer.statesOnGpu) await state.trainer.download();
    const bytes = state.trainer.saveCheckpoint();
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([bytes], { type: "application/octet-stream" }));
    a.download = `trainops-demo-step${demo.steps}.safetensors`;
    a.click();
    setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  }));

  await run(state, target);
  demo.done = true;
}

function fail(e) {
  console.error(e);
  demo.error = String(e?.stack ?? e);
  demo.done = true;
  status(`error: ${e?.message ?? e}`);
}

main().catch(fail);
