// An external worker in another language (Node.js, no dependencies): it runs jobs of an
// external job type over the orchestrator's HTTP API, as docs/api.md describes.
//
//   ORCHESTRATOR_URL=http://127.0.0.1:8000 ORCHESTRATOR_TOKEN=orc_... \
//     node external_worker.js WORKER_NAME JOB_TYPE
//
// Loop: claim (long-poll), heartbeat while the job runs, then complete it. What a job does is
// in its payload: {sleep_ms, fail: "transient" | "permanent", fail_until (attempts failing
// transiently first), retry_after, output}. Each step is
// logged as one JSON line on stdout ({"event": "claimed" | "completed" | "refused", ...}), which
// the tests read.

const base = process.env.ORCHESTRATOR_URL;
const token = process.env.ORCHESTRATOR_TOKEN;
const [worker, jobType] = process.argv.slice(2);

function log(event, fields) {
  process.stdout.write(JSON.stringify({ event, worker, ...fields }) + "\n");
}

async function call(path, body) {
  const response = await fetch(base + path, {
    method: "POST",
    headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  return { status: response.status, answer };
}

function outcomeOf(payload, attempt) {
  if (payload.fail === "transient" || attempt <= (payload.fail_until ?? 0)) {
    return {
      status: "failure",
      error: { message: "upstream said 503", code: "HTTP_503", classification: "TRANSIENT_APP" },
    };
  }
  if (payload.fail === "permanent") {
    return {
      status: "failure",
      error: { message: "upstream said 400", code: "HTTP_400", classification: "PERMANENT" },
    };
  }
  if (payload.retry_after !== undefined) {
    return { status: "retry_later", retry_after_seconds: payload.retry_after, message: "busy" };
  }
  return { status: "success", output: { echo: payload.output ?? null, by: worker } };
}

async function run(task) {
  const lease = { job_id: task.job_id, attempt: task.attempt, lease_token: task.lease_token };
  log("claimed", lease);
  let lost = false;
  const beat = setInterval(async () => {
    const { status } = await call("/api/v1/internal/heartbeat", lease);
    if (status === 409) lost = true; // swept or cancelled: stop, report nothing
  }, task.heartbeat_interval * 1000);
  try {
    await new Promise((resolve) => setTimeout(resolve, task.payload.sleep_ms ?? 0));
  } finally {
    clearInterval(beat);
  }
  if (lost) {
    log("lost", lease);
    return;
  }
  const { status, answer } = await call("/api/v1/internal/task-complete", {
    ...lease,
    ...outcomeOf(task.payload, task.attempt),
  });
  log(status === 200 ? "completed" : "refused", { ...lease, status, answer });
}

async function main() {
  log("started", {});
  for (;;) {
    const { status, answer } = await call("/api/v1/internal/task-claim", {
      job_types: [jobType],
      worker,
      limit: 1,
      wait_seconds: 5,
    });
    if (status !== 200) {
      log("claim_failed", { status, answer });
      await new Promise((resolve) => setTimeout(resolve, 500));
      continue;
    }
    for (const task of answer.tasks) await run(task);
  }
}

main().catch((error) => {
  log("crashed", { error: String(error) });
  process.exit(1);
});
