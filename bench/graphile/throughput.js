// Graphile Worker's no-op throughput, the way its own perfTest (perfTest/run.js) times it: N jobs
// queued beforehand (WorkerUtils.addJobs, 1000 per call, tables ANALYZEd after), then one worker
// pool in this process with the given concurrency runs in "run once" mode (runOnce: it stops when
// the queue is empty, like Procrastinate's run_worker(wait=False)), NO_LOG_SUCCESS=1 as in
// perfTest, a pool of concurrency + 1 connections (perfTest's -m), opened before the clock starts.
// Timed from the worker's start until every job is done: the run has returned and no job is left
// in graphile_worker.jobs (Graphile deletes a job when it completes; without batching a completion
// is not awaited by the worker, so the last ones may still be in flight when the run returns).
// Modes: "default" (no batching options), "batched" (BATCHED below: Graphile's documented
// performance configuration, https://worker.graphile.org/docs/performance).
// Connects with the libpq environment (PGHOST, PGDATABASE, ...); the database holds the Graphile
// schema or nothing (it is migrated here) and its jobs are truncated first. Prints one JSON line.
// Run by bench/throughput.py: node throughput.js JOBS CONCURRENCY MODE
process.env.NO_LOG_SUCCESS = "1"; // read when graphile-worker is loaded
const { Pool } = require("pg");
const { Logger, makeWorkerUtils, runMigrations, runOnce } = require("graphile-worker");
const { version } = require("./node_modules/graphile-worker/package.json");

const BATCHED = { localQueue: { size: 500 }, completeJobBatchDelay: 0, failJobBatchDelay: 0 };
const MODES = { default: {}, batched: BATCHED };

const jobs = Number(process.argv[2] || 20000);
const concurrency = Number(process.argv[3] || 10);
const mode = process.argv[4] || "default";

async function main() {
  if (!(mode in MODES)) throw new Error(`unknown mode ${mode}`);
  const logger = new Logger(() => () => {});
  await fill(logger);

  const pool = new Pool({ max: concurrency + 1 });
  const report = (err) => console.error("pg:", err.message);
  pool.on("error", report);
  pool.on("connect", (client) => client.on("error", report));
  const clients = await Promise.all(Array.from({ length: concurrency + 1 }, () => pool.connect()));
  clients.forEach((client) => client.release());

  let ran = 0;
  const started = process.hrtime.bigint();
  await runOnce(
    {
      pgPool: pool,
      concurrency,
      noHandleSignals: true,
      logger,
      preset: { worker: MODES[mode] },
    },
    { noop: () => void ran++ },
  );
  let left;
  while ((left = await remaining(pool)) > 0) await new Promise((r) => setTimeout(r, 1));
  const seconds = Number(process.hrtime.bigint() - started) / 1e9;
  await pool.end();
  if (ran !== jobs) throw new Error(`${ran} of ${jobs} jobs ran`);
  console.log(JSON.stringify({ version, mode, options: MODES[mode], jobs, concurrency, seconds }));
}

// Migrate, empty the queue, add the jobs and ANALYZE, on connections of its own.
async function fill(logger) {
  const pool = new Pool();
  try {
    await runMigrations({ pgPool: pool, logger });
    await pool.query(
      "TRUNCATE graphile_worker._private_jobs, graphile_worker._private_job_queues RESTART IDENTITY CASCADE",
    );
    const utils = await makeWorkerUtils({ pgPool: pool, logger });
    try {
      for (let start = 0; start < jobs; start += 1000) {
        const specs = [];
        for (let i = start; i < Math.min(jobs, start + 1000); i++) {
          specs.push({ identifier: "noop", payload: { i } });
        }
        await utils.addJobs(specs);
      }
    } finally {
      await utils.release();
    }
    if ((await remaining(pool)) !== jobs) throw new Error("the jobs were not all queued");
    await pool.query(
      "ANALYZE graphile_worker._private_jobs; ANALYZE graphile_worker._private_tasks; " +
        "ANALYZE graphile_worker._private_job_queues",
    );
  } finally {
    await pool.end();
  }
}

async function remaining(pool) {
  const { rows } = await pool.query("SELECT count(*)::int AS n FROM graphile_worker.jobs");
  return rows[0].n;
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
