// A producer written for Graphile Worker, unchanged: graphile-worker's own WorkerUtils and
// quickAddJob (the version bench/graphile/package.json pins), on the database of
// DATABASE_URL. argv: the graphile-worker module's path, then the calls as JSON
// ([[method, ...args]]); prints one JSON line: each call's answer, or its error's code and message.
const { makeWorkerUtils, quickAddJob } = require(process.argv[2]);

const DATES = new Set(["runAt"]);

function revive(key, value) {
  return DATES.has(key) && typeof value === "string" ? new Date(value) : value;
}

async function main() {
  const connectionString = process.env.DATABASE_URL;
  const calls = JSON.parse(process.argv[3], revive);
  const utils = await makeWorkerUtils({ connectionString });
  const answers = [];
  try {
    for (const [method, ...args] of calls) {
      try {
        const answer =
          method === "quickAddJob"
            ? await quickAddJob({ connectionString }, ...args)
            : await utils[method](...args);
        answers.push({ ok: answer });
      } catch (error) {
        answers.push({ error: { code: error.code, message: error.message } });
      }
    }
  } finally {
    await utils.release();
  }
  console.log(JSON.stringify(answers));
}

main().catch((error) => {
  console.error(error.stack || String(error));
  process.exit(1);
});
