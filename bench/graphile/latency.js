// Graphile Worker's submit -> start latency, by its own method (perfTest/latencyTest.js):
// worker and client in one process, concurrency 1, each job added (graphile_worker.add_job on a
// dedicated connection) the moment the previous one started; the time from just before the add
// to the task's first line. Connects with the libpq environment (PGHOST, PGDATABASE, ...) and
// prints one JSON line: the latencies in ms, sorted, and the CPU time per job (us) of this process
// and of the server's processes. Run by bench/latency.py.
const fs = require("fs");
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
  let cpu;
  try {
    for (let i = -WARM_UP; i < samples; i++) {
      if (i === 0) cpu = await cpuNow(client);
      const started = new Promise((resolve) => (wakes[i] = resolve));
      startedAt[i] = process.hrtime.bigint();
      await client.query("SELECT graphile_worker.add_job('latency', json_build_object('id', $1::int))", [i]);
      await started;
    }
    cpu = cpuSince(cpu, await cpuNow(client), samples);
  } finally {
    client.release();
  }
  await worker.release();
  await pool.end();
  console.log(JSON.stringify({ version, latencies: latencies.sort((a, b) => a - b), cpu }));
}

// CPU time so far: this process's (us), and each server process's serving this database (ns,
// from /proc: null when the server is not a process of this machine), as bench/common.py reads it.
async function cpuNow(client) {
  const { rows } = await client.query(
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()",
  );
  const server = {};
  for (const { pid } of rows) {
    try {
      if (!fs.readFileSync(`/proc/${pid}/cmdline`).toString().startsWith("postgres")) {
        return { process: process.cpuUsage(), server: null };
      }
      server[pid] = Number(fs.readFileSync(`/proc/${pid}/schedstat`, "utf8").split(" ")[0]);
    } catch {
      // ended since the query, or the server is elsewhere
    }
  }
  return { process: process.cpuUsage(), server: Object.keys(server).length ? server : null };
}

// Microseconds per job between two cpuNow() readings.
function cpuSince(before, after, jobs) {
  const used = process.cpuUsage(before.process);
  let server = null;
  if (before.server && after.server) {
    server = 0;
    for (const [pid, ns] of Object.entries(after.server)) server += ns - (before.server[pid] || 0);
    server /= 1000 * jobs;
  }
  return { process: (used.user + used.system) / jobs, server };
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
