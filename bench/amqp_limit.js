// The wire-format broker limit (issue 21): Node's amqplib publishing the
// messages `relay outbox` publishes, as fast as the broker confirms them.
//
//   node bench/amqp_limit.js URL EXCHANGE ROUTING_KEY COUNT WINDOW
//
// EXCHANGE "" publishes to a queue through the default exchange. Every
// message is what relay sends for a row of one of 100 keys (docs/wire-format.md):
// a 200-byte compact JSON body, content_type application/json, persistent,
// message_id, type "Bench", timestamp (whole seconds), the x-relay-key header,
// mandatory; publisher confirms, WINDOW publishes awaiting their confirm.
// Prints one JSON line: messages, seconds, cpu_seconds, returned.
// amqplib comes from bench/.node (bench/reference.py installs it; NODE_PATH).
"use strict";

const amqp = require("amqplib");
const crypto = require("crypto");

const [url, exchange, routingKey, countArg, windowArg] = process.argv.slice(2);
const count = parseInt(countArg, 10);
const window = parseInt(windowArg || "1000", 10);
const KEYS = 100;
const PAD = "x".repeat(158);

function body(i) {
  // bench.common.payload(i): {"i":"0000000001","pad":"xxx...","kind":"bench"}
  return Buffer.from(`{"i":"${String(i).padStart(10, "0")}","pad":"${PAD}","kind":"bench"}`);
}

async function main() {
  if (body(1).length !== 200) throw new Error("the body is not 200 bytes");
  const conn = await amqp.connect(url);
  const ch = await conn.createConfirmChannel();
  let returned = 0;
  ch.on("return", () => { returned += 1; });
  const cpu0 = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  const timestamp = Math.floor(Date.now() / 1000);
  let inFlight = 0;
  let failed = null;
  let wake = null;
  const settled = (err) => {
    inFlight -= 1;
    if (err && !failed) failed = err;
    if (wake && inFlight < window) { const w = wake; wake = null; w(); }
  };
  for (let i = 1; i <= count; i++) {
    if (inFlight >= window) await new Promise((resolve) => { wake = resolve; });
    if (failed) break;
    inFlight += 1;
    const ok = ch.publish(exchange, routingKey, body(i), {
      contentType: "application/json",
      persistent: true,
      messageId: crypto.randomUUID(),
      type: "Bench",
      timestamp,
      headers: { "x-relay-key": `k${i % KEYS}` },
      mandatory: true,
    }, settled);
    if (!ok) await new Promise((resolve) => ch.once("drain", resolve));
  }
  await ch.waitForConfirms();
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  const cpu = process.cpuUsage(cpu0);
  await ch.close();
  await conn.close();
  if (failed) throw failed;
  process.stdout.write(JSON.stringify({
    messages: count, seconds, cpu_seconds: (cpu.user + cpu.system) / 1e6, returned,
  }) + "\n");
}

main().catch((err) => { console.error(err); process.exit(1); });
