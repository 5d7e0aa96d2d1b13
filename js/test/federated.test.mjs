// The federated-learning recipe of docs/languages/javascript.md, run: clients train on their
// own data, a server averages their getParameters() and sends the average back with
// setParameters (federated averaging). Two clients of the MLP, five rounds of two local steps.
import { test } from "node:test";
import assert from "node:assert/strict";
import * as ort from "onnxruntime-node";
import { Trainer } from "../src/index.js";
import { artifacts, batches, requireReference } from "./helpers.mjs";

requireReference();

// --- the recipe (docs/languages/javascript.md) ---
function average(parts, weights) {
  const total = weights.reduce((a, b) => a + b, 0);
  const avg = new Float32Array(parts[0].length);
  for (let i = 0; i < avg.length; i++) {
    let s = 0;
    for (let k = 0; k < parts.length; k++) s += weights[k] * parts[k][i];
    avg[i] = s / total;
  }
  return avg;
}

async function federatedRound(clients, dataOf, localSteps) {
  const parts = [];
  const weights = [];
  for (const client of clients) {               // on each device: train on its own data
    for (let k = 0; k < localSteps; k++) await client.step(dataOf(client).next().value);
    parts.push(client.getParameters());          // sent to the server
    weights.push(localSteps);                    // (e.g. how many examples it saw)
  }
  const global = average(parts, weights);       // on the server
  for (const client of clients) client.setParameters(global);   // sent back
  return global;
}
// --- end of the recipe ---

test("federated averaging of two clients: the average reaches both, and it learns both clients' data", async () => {
  const options = { ort, executionProviders: ["cpu"], intraOpNumThreads: 1 };
  const data = batches(ort, "mlp");
  const clients = [await Trainer.fromArtifacts(artifacts("mlp"), options),
    await Trainer.fromArtifacts(artifacts("mlp"), options)];
  // client 0 holds the first ten batches, client 1 the last ten
  const own = new Map(clients.map((c, k) => [c, data.slice(10 * k, 10 * k + 10)[Symbol.iterator]()]));
  const probe = await Trainer.fromArtifacts(artifacts("mlp"), options);
  const lossOnAll = async (params) => {
    probe.setParameters(params);
    let s = 0;
    for (const feeds of data) s += (await probe.eval(feeds)).loss.data[0];
    return s / data.length;
  };
  const before = await lossOnAll(clients[0].getParameters());
  for (let round = 0; round < 5; round++) {
    const a = clients[0].getParameters().slice();
    const b = clients[1].getParameters().slice();
    const parts = [];
    for (const c of clients) {
      for (let s = 0; s < 2; s++) await c.step(own.get(c).next().value);
      parts.push(c.getParameters());
    }
    assert.notDeepEqual(parts[0], parts[1], "the clients trained on different data");
    assert.deepEqual(a, b, "each round starts from one model");
    // the round as the recipe does it, from the same local models
    const global = average(parts, [2, 2]);
    // the mean of two float32 values, exact in a double, rounded once
    parts[0].forEach((v, i) => assert.equal(global[i], Math.fround((v + parts[1][i]) / 2)));
    for (const c of clients) c.setParameters(global);
    assert.deepEqual(clients[0].getParameters(), global);
    assert.deepEqual(clients[1].getParameters(), global);
  }
  const after = await lossOnAll(clients[0].getParameters());
  assert.ok(after < before * 0.9, `the averaged model's loss on both clients' data: ${before} -> ${after}`);
});

test("federatedRound (the recipe as written) runs", async () => {
  const options = { ort, executionProviders: ["cpu"], intraOpNumThreads: 1 };
  const data = batches(ort, "mlp");
  const clients = [await Trainer.fromArtifacts(artifacts("mlp"), options),
    await Trainer.fromArtifacts(artifacts("mlp"), options)];
  const own = new Map(clients.map((c, k) => [c, data.slice(10 * k, 10 * k + 10)[Symbol.iterator]()]));
  const global = await federatedRound(clients, (c) => own.get(c), 2);
  assert.deepEqual(clients[0].getParameters(), global);
  assert.deepEqual(clients[1].getParameters(), global);
  assert.equal(clients[0].T, 3n);
});
