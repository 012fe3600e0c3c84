// An external worker in another language (Node.js, no dependencies): it runs jobs of an
// external job type over the orchestrator's HTTP API, as docs/api.md describes.
//
//   ORCHESTRATOR_URL=http://127.0.0.1:8000 ORCHESTRATOR_TOKEN=orc_... \
//     node external_worker.js WORKER_NAME JOB_TYPE
//
// Loop: claim (long-poll), heartbeat while the job runs, then complete it. What a job does is
// in its payload: {sleep_ms, stream, calls, fail: "transient" | "permanent", fail_until
// (attempts failing transiently first), retry_after, output}. With `stream` (texts), each
// attempt writes them to the job's live output, a batch each, then a progress record
// (docs/api.md, "An external worker's live output"). With `calls` (and `llm_url`, `model`,
// `max_tokens`), the job makes that many LLM calls to the Messages API at `llm_url`, each
// admitted under its flow key before it is sent and its usage recorded after (docs/api.md, "An
// external worker's LLM calls"); a call that parks the job ends the attempt. Each step is
// logged as one JSON line on stdout ({"event": "claimed" | "output_written" | "call_admitted" |
// "call_recorded" | "parked" | "completed" | "refused", ...}), which the tests read.

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

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// The job's nth LLM call: admitted before it is sent (the answer comes once its room has), then
// sent, then its usage recorded. False when the attempt is over (the job was parked, or the
// lease is gone): stop, report nothing.
async function llmCall(lease, payload, n) {
  const prompt = `question ${n}`;
  const maxTokens = payload.max_tokens ?? 16;
  const units = Math.ceil(prompt.length / 4) + maxTokens; // the call's estimate
  // its own id (one per call of the attempt): asked again after a lost answer, counted once
  const admit = await call("/api/v1/internal/call-admit", { ...lease, units, call_id: `call-${n}` });
  if (admit.status !== 200) {
    log("refused", { ...lease, call: n, status: admit.status, answer: admit.answer });
    return false;
  }
  if (admit.answer.decision === "park") {
    const { key, waiting_on } = admit.answer;
    log("parked", { ...lease, call: n, key, waiting_on });
    return false;
  }
  log("call_admitted", { ...lease, call: n }); // "go" (a moment's wait for its room included)
  const sent = performance.now();
  const response = await fetch(payload.llm_url + "/v1/messages", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({
      model: payload.model,
      max_tokens: maxTokens,
      messages: [{ role: "user", content: prompt }],
    }),
  });
  const reply = await response.json();
  const { status, answer } = await call("/api/v1/internal/call-usage", {
    ...lease,
    model: payload.model,
    input_tokens: reply.usage.input_tokens,
    output_tokens: reply.usage.output_tokens,
    call_id: reply.id, // a report sent again under it is recorded once
    sent_seconds_ago: (performance.now() - sent) / 1000, // a duration: dated on the server
  });
  log(status === 200 ? "call_recorded" : "refused", { ...lease, call: n, status, answer });
  return status === 200;
}

// The attempt's live output: each text a batch of its own, then a progress record, the batches
// numbered 1, 2... in the attempt (one sent again under its number is written once). False
// when the lease is gone: stop, report nothing.
async function writeOutput(lease, texts) {
  const batches = [
    ...texts.map((body) => [{ kind: "text", body }]),
    [{ kind: "progress", body: { attempt: lease.attempt, texts: texts.length } }],
  ];
  for (const [n, chunks] of batches.entries()) {
    const batch = { ...lease, batch: n + 1, chunks };
    const { status, answer } = await call("/api/v1/internal/task-output", batch);
    if (status !== 200) {
      log("refused", { ...lease, batch: n + 1, status, answer });
      return false;
    }
  }
  log("output_written", { ...lease, batches: batches.length });
  return true;
}

async function run(task) {
  const lease = { job_id: task.job_id, attempt: task.attempt, lease_token: task.lease_token };
  log("claimed", lease);
  let lost = false;
  let going = true;
  const beat = setInterval(async () => {
    const { status } = await call("/api/v1/internal/heartbeat", lease);
    if (status === 409) lost = true; // swept or cancelled: stop, report nothing
  }, task.heartbeat_interval * 1000);
  try {
    await sleep(task.payload.sleep_ms ?? 0);
    if (task.payload.stream) going = await writeOutput(lease, task.payload.stream);
    for (let n = 1; going && n <= (task.payload.calls ?? 0); n++) {
      going = await llmCall(lease, task.payload, n);
    }
  } finally {
    clearInterval(beat);
  }
  if (!going) return; // parked, or its lease gone: the attempt is over
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
