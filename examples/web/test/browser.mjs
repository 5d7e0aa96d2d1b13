// The demo page in a real browser: Debian's chromium driven headless by playwright-core.
// Starts `python -m trainops serve-demo` on a free port, opens ?steps=N&backend=wasm, waits
// for window.trainopsDemo.done, and checks that the loss falls and that it equals, within
// the WASM bound below, the losses of the same run in Node.js (the repository's JavaScript
// trainer on onnxruntime-node's CPU EP, the batches of demo.js), and the Python portable
// trainer's (reference.json, made by serve-demo). Then ?steps=M&backend=webgpu: the page
// trains on WebGPU (an adapter exists without a GPU too: Chromium's SwiftShader, a
// software Vulkan) within the same bound of the Node.js run. Each page's downloaded
// checkpoint resumes in Python (Trainer.from_artifacts) at its step and scores the test
// digits as the page did. Saves a screenshot (with a digit drawn and predicted), the
// checkpoints and the runs' losses under .ci-artifacts/.
//
//   node examples/web/test/browser.mjs [--steps N] [--webgpu-steps M] [--docs]
//   (--webgpu-steps 0: no WebGPU run; --docs: the screenshot to docs/demo-web.png too)
// Environment: PYTHON (default .venv/bin/python, else python3), CHROMIUM (/usr/bin/chromium),
// WEBGPU_ADAPTER (default swiftshader; "default": the browser's own choice, a real GPU).
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdirSync, copyFileSync, readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { chromium } from "playwright-core";

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, "../../..");
const args = process.argv.slice(2);
const option = (name, value) => Number(args.includes(name) ? args[args.indexOf(name) + 1] : value);
const steps = option("--steps", 100);
const gpuSteps = option("--webgpu-steps", 20);
const adapter = process.env.WEBGPU_ADAPTER ?? "swiftshader";
const out = join(root, ".ci-artifacts");
mkdirSync(out, { recursive: true });

// The WASM bound: how far the page's losses may be from the native CPU run's, relative to
// the loss: |wasm - cpu| <= REL * |cpu| at every step. Both runs execute the same graph with
// onnxruntime's CPU kernels, but the WASM build's MLAS (128-bit SIMD) blocks and orders the
// convolutions' and products' sums differently from the x86 build's, so each step's float32
// results differ in their last bits and the runs drift apart through the updates. For one
// forward pass a float32 sum of n terms in another order moves by at most gamma(n) = n u /
// (1 - n u) of its terms' magnitudes (Higham; u = 2^-24): 4.3e-6 for the CNN's longest sums
// (72 products in conv2). The drift over Adam steps has no simple bound; REL = 1e-4 is
// js/test/wasm.test.mjs's RELATIVE_BOUND, about 300 times the worst measured here over 100
// steps (3.7e-7, onnxruntime-web 1.30.0 in Chromium 148 against onnxruntime-node 1.30.0 and
// Python's onnxruntime 1.32.0), and still catches a wrong step (a missed or doubled update
// moves a loss by 1e-2 or more). Chromium and Node.js run the same WASM binary: the page's
// first 20 losses equal js/test/wasm.test.mjs's (onnxruntime-web in Node.js, the same batches,
// js/.reference/demo_cnn_wasm_losses.json, written by `npm test` in js/) bit for bit.
// The WebGPU run is held to the same bound, by the same argument: its kernels (WGSL shaders,
// the nodes WebGPU lacks on the CPU beside it) sum in other orders again, and WGSL's exp and
// log are a few ulps from exact where the CPU's are within one; measured over 20 steps on
// SwiftShader (not a GPU: what CI has): 1.1e-7 against onnxruntime-node.
const REL = 1e-4;

function python() {
  if (process.env.PYTHON) return process.env.PYTHON;
  const venv = join(root, ".venv", "bin", "python");
  return existsSync(venv) ? venv : "python3";
}

function serve() {
  const env = { ...process.env, PYTHONPATH: join(root, "python") + (process.env.PYTHONPATH ? ":" + process.env.PYTHONPATH : "") };
  const child = spawn(python(), ["-m", "trainops", "serve-demo", "--port", "0", "--no-install",
                                 "--reference-steps", String(steps)], { cwd: root, env, stdio: ["ignore", "pipe", "inherit"] });
  return new Promise((ok, fail) => {
    let text = "";
    const timer = setTimeout(() => fail(new Error(`serve-demo printed no URL in 120 s:\n${text}`)), 120000);
    child.stdout.on("data", (d) => {
      text += d;
      process.stdout.write(d);
      const m = /serving the trainops demo at (http:\/\/\S+)/.exec(text);
      const site = /digits in (\S+)/.exec(text);
      if (m) { clearTimeout(timer); ok({ child, url: m[1], site: site?.[1] }); }
    });
    child.on("exit", (code) => { clearTimeout(timer); fail(new Error(`serve-demo exited (${code}):\n${text}`)); });
  });
}

async function nodeRun(url) {
  const require = createRequire(join(root, "js", "package.json"));
  const ort = require("onnxruntime-node");
  const { Trainer } = await import(pathToFileURL(join(root, "js", "src", "index.js")).href);
  const { train } = await import(pathToFileURL(join(root, "examples", "web", "demo.js")).href);
  const r = await train({ ort, Trainer, base: new URL(url), executionProviders: ["cpu"], steps, every: 0 });
  return { losses: r.losses, version: ort.env?.versions?.common ?? "?" };
}

async function drawSeven(page) {
  const box = await page.locator("#pad").boundingBox();
  const p = (x, y) => [box.x + x * box.width, box.y + y * box.height];
  await page.mouse.move(...p(0.15, 0.15));
  await page.mouse.down();
  for (const [x, y] of [[0.85, 0.15], [0.6, 0.5], [0.45, 0.85]]) await page.mouse.move(...p(x, y), { steps: 12 });
  await page.mouse.up();
  await page.waitForFunction(() => /\d/.test(document.getElementById("guess").textContent), null, { timeout: 30000 });
  return page.locator("#guess").textContent();
}

// Trainer.from_artifacts over a copy of the served artifacts with the page's checkpoint:
// its T and the exported model's accuracy on the test digits (plain onnxruntime).
function resumeInPython(siteDir, checkpoint) {
  const code = `
import json, shutil, sys, tempfile
import numpy as np, onnxruntime as ort
from trainops import Trainer
site, ck = sys.argv[1], sys.argv[2]
d = tempfile.mkdtemp()
shutil.copytree(site + "/artifacts", d, dirs_exist_ok=True)
shutil.copy(ck, d + "/checkpoint.safetensors")
tr = Trainer.from_artifacts(d, threads=1)
meta = json.load(open(site + "/data/digits.json"))
raw = open(site + "/data/digits.bin", "rb").read()
o = meta["offsets"]
x = np.frombuffer(raw, "<f4", meta["test"] * 64, o["x_test"]).reshape(-1, 1, 8, 8)
t = np.frombuffer(raw, np.uint8, meta["test"], o["t_test"]).astype(np.int64)
s = ort.InferenceSession(tr.export().SerializeToString(), providers=["CPUExecutionProvider"])
acc = float(np.mean(s.run(["logits"], {"x": x, "t": t})[0].argmax(1) == t))
shutil.rmtree(d)
print(json.dumps({"T": tr.T, "accuracy": acc}))
`;
  const env = { ...process.env, PYTHONPATH: join(root, "python") + (process.env.PYTHONPATH ? ":" + process.env.PYTHONPATH : "") };
  const r = spawnSync(python(), ["-c", code, siteDir, checkpoint], { env, encoding: "utf8" });
  if (r.status !== 0) throw new Error(`Python could not resume the page's checkpoint:\n${r.stderr}`);
  return JSON.parse(r.stdout.trim().split("\n").at(-1));
}

const ulps = (a, b) => Math.abs(new Int32Array(Float32Array.of(a).buffer)[0] - new Int32Array(Float32Array.of(b).buffer)[0]);

const { child, url, site } = await serve();
let browser;
let failed = false;
let webgpu = null;
try {
  browser = await chromium.launch({ executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
                                    args: ["--no-sandbox", "--enable-unsafe-webgpu",
                                           ...(adapter === "default" ? [] : [`--use-webgpu-adapter=${adapter}`])] });
  const page = await browser.newPage({ viewport: { width: 1100, height: 760 } });
  const logs = [];
  page.on("console", (m) => logs.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => logs.push(`pageerror: ${e.message}`));
  const t0 = Date.now();
  await page.goto(`${url}?steps=${steps}&backend=wasm`);
  await page.waitForFunction(() => window.trainopsDemo?.done, null, { timeout: 240000 });
  const demo = await page.evaluate(() => window.trainopsDemo);
  const seconds = (Date.now() - t0) / 1000;
  if (demo.error) throw new Error(`the page failed: ${demo.error}\n${logs.join("\n")}`);
  const guess = await drawSeven(page);
  await page.screenshot({ path: join(out, "demo-web.png") });
  const [download] = await Promise.all([page.waitForEvent("download"), page.click("#download")]);
  const checkpoint = join(out, "demo-web-checkpoint.safetensors");
  await download.saveAs(checkpoint);
  if (args.includes("--docs")) copyFileSync(join(out, "demo-web.png"), join(root, "docs", "demo-web.png"));

  const node = await nodeRun(url);
  const python = await (await fetch(new URL("data/reference.json", url))).json();
  const web = demo.losses;
  const check = (ok, what) => { console.log(`${ok ? "ok  " : "FAIL"} ${what}`); if (!ok) failed = true; };
  const mean = (a) => a.reduce((s, v) => s + v, 0) / a.length;
  check(demo.backend === "wasm", `the page trained on ${demo.backend} (asked: wasm)`);
  check(web.length === steps && demo.steps === steps, `${web.length} steps in ${seconds.toFixed(1)} s`);
  check(mean(web.slice(-10)) < 0.5 * mean(web.slice(0, 10)),
        `the loss falls: ${mean(web.slice(0, 10)).toFixed(4)} (first 10) -> ${mean(web.slice(-10)).toFixed(4)} (last 10); test accuracy ${JSON.stringify(demo.accuracies.at(-1))}`);
  const worst = (ref) => web.reduce((w, v, i) => Math.max(w, Math.abs(v - ref[i]) / Math.abs(ref[i])), 0);
  const firstUlps = (ref) => ulps(web[0], ref[0]);
  check(node.losses.length === steps && worst(node.losses) <= REL,
        `WASM vs onnxruntime-node ${node.version} (CPU): worst relative difference ${worst(node.losses).toExponential(2)} <= ${REL.toExponential(2)} (step 1: ${firstUlps(node.losses)} ulps)`);
  check(python.losses.length === steps && worst(python.losses) <= REL,
        `WASM vs Python onnxruntime ${python.onnxruntime} (CPU): worst relative difference ${worst(python.losses).toExponential(2)} (step 1: ${firstUlps(python.losses)} ulps)`);
  const nodeWasm = join(root, "js", ".reference", "demo_cnn_wasm_losses.json");
  if (existsSync(nodeWasm)) {
    const ref = JSON.parse(readFileSync(nodeWasm, "utf8")).wasm;
    check(ref.every((v, i) => Object.is(v, web[i])),
          `the page's first ${ref.length} losses are onnxruntime-web's in Node.js bit for bit (${nodeWasm})`);
  } else {
    console.log(`info ${nodeWasm} not found (npm test in js/ writes it): the WASM-in-Node comparison is skipped`);
  }
  if (gpuSteps > 0) {
    const gpu = await browser.newPage();
    gpu.on("pageerror", (e) => logs.push(`pageerror (webgpu): ${e.message}`));
    const t1 = Date.now();
    await gpu.goto(`${url}?steps=${gpuSteps}&backend=webgpu`);
    await gpu.waitForFunction(() => window.trainopsDemo?.done, null, { timeout: 300000 });
    const g = await gpu.evaluate(() => window.trainopsDemo);
    if (g.error) throw new Error(`the WebGPU page failed: ${g.error}\n${logs.join("\n")}`);
    const rel = g.losses.reduce((w, v, i) => Math.max(w, Math.abs(v - node.losses[i]) / Math.abs(node.losses[i])), 0);
    check(g.backend === "webgpu" && g.losses.length === gpuSteps,
          `the page trained ${g.losses.length} steps on ${g.backend} (asked: webgpu, adapter ${adapter}) in ${((Date.now() - t1) / 1000).toFixed(1)} s`);
    check(rel <= REL, `WebGPU vs onnxruntime-node (CPU): worst relative difference ${rel.toExponential(2)} <= ${REL.toExponential(2)} (step 1: ${ulps(g.losses[0], node.losses[0])} ulps)`);
    // the states come back from GPU memory into the checkpoint (trainer.download())
    const [dl] = await Promise.all([gpu.waitForEvent("download"), gpu.click("#download")]);
    const gpuCheckpoint = join(out, "demo-webgpu-checkpoint.safetensors");
    await dl.saveAs(gpuCheckpoint);
    const back = resumeInPython(site, gpuCheckpoint);
    check(back.T === gpuSteps + 1 && Math.abs(back.accuracy - g.accuracies.at(-1)[1]) <= 2 / 1024,
          `the WebGPU page's checkpoint resumes in Python: T ${back.T}, test accuracy ${back.accuracy} (the page: ${g.accuracies.at(-1)[1]})`);
    webgpu = g.losses;
  }
  // The checkpoint the page downloaded resumes in Python, at the page's step, and scores the
  // test digits as the page did (argmax decisions: only a near-tie of two logits, within
  // the runs' rounding differences, could flip one; none is expected, 2 of 1024 allowed).
  const resumed = resumeInPython(site, checkpoint);
  const pageAcc = demo.accuracies.at(-1)[1];
  check(resumed.T === steps + 1 && Math.abs(resumed.accuracy - pageAcc) <= 2 / 1024,
        `the downloaded checkpoint resumes in Python (Trainer.from_artifacts): T ${resumed.T}, test accuracy ${resumed.accuracy} (the page: ${pageAcc})`);
  const same = node.losses.every((v, i) => Object.is(v, python.losses[i]));
  console.log(`info onnxruntime-node ${node.version} and Python onnxruntime ${python.onnxruntime}: ${same ? "the same losses, bit for bit" : "losses differ (worst relative " + node.losses.reduce((w, v, i) => Math.max(w, Math.abs(v - python.losses[i]) / Math.abs(python.losses[i])), 0).toExponential(2) + ")"}`);
  console.log(`info drawn 7 predicted as ${guess}; screenshot ${join(out, "demo-web.png")}`);
  writeFileSync(join(out, "browser-losses.json"), JSON.stringify({ steps, bound: REL, wasm: web, webgpu, node: node.losses, python: python.losses, accuracies: demo.accuracies, seconds }, null, 1));
} catch (e) {
  console.error(e);
  failed = true;
} finally {
  await browser?.close();
  child.kill("SIGINT");
}
process.exit(failed ? 1 : 0);
