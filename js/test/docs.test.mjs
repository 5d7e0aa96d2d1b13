// docs/languages/javascript.md's Node.js example, run as written on the demo CNN's artifacts
// (a copy in a temporary folder, as "run/"): it trains, predicts and writes a checkpoint that
// this package reads back.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, writeFileSync, mkdtempSync, cpSync, rmSync } from "node:fs";
import { execFileSync } from "node:child_process";
import { tmpdir } from "node:os";
import { fileURLToPath } from "node:url";
import path from "node:path";
import { readSafetensors } from "../src/index.js";
import { REFERENCE, artifacts, requireReference } from "./helpers.mjs";

requireReference();
const PAGE = fileURLToPath(new URL("../../docs/languages/javascript.md", import.meta.url));

test("the page's Node.js example runs", () => {
  const text = readFileSync(PAGE, "utf8");
  const section = text.slice(text.indexOf("\n## Node.js\n"));
  const code = /```js\n([\s\S]*?)```/.exec(section)[1];
  assert.match(code, /from "trainops"/);
  // inside js/ (the package imports itself by its name), run with a temporary folder as cwd
  const script = path.join(REFERENCE, "doc_example.mjs");
  writeFileSync(script, code);
  const cwd = mkdtempSync(path.join(tmpdir(), "trainops-doc-"));
  try {
    cpSync(artifacts("demo_cnn"), path.join(cwd, "run"), { recursive: true });
    const out = execFileSync(process.execPath, [script], { cwd, encoding: "utf8" });
    assert.match(out, /^step 1: loss \d+\.\d{4}\n/);
    assert.equal(out.trim().split("\n").length, 20);
    const { metadata } = readSafetensors(new Uint8Array(readFileSync(path.join(cwd, "run", "checkpoint.safetensors"))));
    assert.equal(metadata.step, "21");
  } finally {
    rmSync(cwd, { recursive: true, force: true });
  }
});
