// Graphile Worker's submit -> start latency, by its own method (perfTest/latencyTest.js):
// worker and client in one process, concurrency 1, each job added (graphile_worker.add_job on a
// dedicated connection) the moment the previous one started; the time from just before the add
// to the task's first line. Connects with the libpq environment (PGHOST, PGDATABASE, ...) and
// prints one JSON line: the latencies in ms, sorted. Run by bench/latency.py.
const { Pool } = require("pg");
const { runMigrations, runTaskList } = require("graphile-worker");
const { version } = require("./node_modules/graphile-worker/package.json");

const WARM_UP = 100;
const samples = Number(process.argv[2] || 1000);

async function main() {
  const pool = new Pool();
  const report = (err) => console.error("pg:", err.message);
  pool.on("error", report);
  pool.on("connect", (client) => client.on("error", report));
  await runMigrations({ pgPool: pool, logger: quiet() });
  const startedAt = {};
  const wakes = {};
  const latencies = [];
  const tasks = {
    latency: ({ id }) => {
      if (id >= 0) latencies.push(msSince(startedAt[id]));
      if (wakes[id]) wakes[id]();
    },
  };
  const worker = runTaskList({ concurrency: 1, logger: quiet() }, tasks, pool);
  const client = await pool.connect();
  try {
    for (let i = -WARM_UP; i < samples; i++) {
      const started = new Promise((resolve) => (wakes[i] = resolve));
      startedAt[i] = process.hrtime.bigint();
      await client.query("SELECT graphile_worker.add_job('latency', json_build_object('id', $1::int))", [i]);
      await started;
    }
  } finally {
    client.release();
  }
  await worker.release();
  await pool.end();
  console.log(JSON.stringify({ version, latencies: latencies.sort((a, b) => a - b) }));
}

function msSince(start) {
  return Number(process.hrtime.bigint() - start) / 1e6;
}

function quiet() {
  const { Logger } = require("graphile-worker");
  return new Logger(() => () => {});
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
