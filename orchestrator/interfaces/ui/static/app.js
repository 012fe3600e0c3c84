// The dashboard's only script (no build step, no dependency): countdowns that tick, live
// regions re-read when the server says something changed, and confirmations before actions.
"use strict";

function seconds(value) {
  if (value < 1) return Math.max(0, Math.round(value * 1000)) + " ms";
  if (value < 60) return value.toPrecision(3).replace(/\.?0+$/, "") + " s";
  if (value < 3600) return Math.floor(value / 60) + " min " + Math.floor(value % 60) + " s";
  return Math.floor(value / 3600) + " h " + Math.floor((value % 3600) / 60) + " min";
}

function tick() {
  const now = Date.now();
  for (const element of document.querySelectorAll("[data-countdown]")) {
    const left = (Date.parse(element.dataset.countdown) - now) / 1000;
    element.textContent = left > 0 ? "in " + seconds(left) : "due now";
    element.classList.toggle("due", left <= 0);
  }
}

// Whether the page shows that it lost the server (or the server its database): the notice
// in base.html, shown while the live stream or a fragment read fails, hidden once one works.
function disconnected(shown) {
  const notice = document.getElementById("disconnected");
  if (notice) notice.hidden = !shown;
}

async function refresh(region) {
  let response;
  try {
    response = await fetch(region.dataset.liveSrc, {
      credentials: "same-origin",
      headers: { accept: "text/html" },
    });
  } catch (error) {
    disconnected(true); // the server itself does not answer
    return;
  }
  if (response.status >= 500) disconnected(true); // the database is away (503)
  if (response.redirected || !response.ok) return; // signed out, or the job is gone
  disconnected(false);
  const html = await response.text();
  // What the reader did while the page was being read counts: the checks and the folds are
  // taken at the instant of the replace, with nothing awaited between them and it.
  const focused = region.contains(document.activeElement) && document.activeElement.value;
  if (focused) return; // never replace a form someone is typing into
  if (region.querySelector("input[type=checkbox]:checked")) return; // nor rows someone chose
  // a fold someone opened stays open (each named by its id)
  const opened = [...region.querySelectorAll("details[id][open]")].map((d) => d.id);
  // a part the page fills itself (the job's live output) stays as it is, in its new place
  const kept = [...region.querySelectorAll("[data-keep][id]")];
  region.innerHTML = html;
  for (const id of opened) {
    const fold = document.getElementById(id);
    if (fold) fold.open = true;
  }
  for (const part of kept) {
    const fresh = document.getElementById(part.id);
    if (fresh) fresh.replaceWith(part);
  }
  arm(region);
  tick();
}

function arm(root) {
  for (const form of root.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  }
}

const RECONNECT_MS = 3000;

// Server-Sent Events from the address `where()` gives, heard by `listen(events)`. A stream that
// ends is connected again by the browser; one refused (503 while the database is away) is not:
// this tries again every RECONNECT_MS until it is taken, or until an answer says there is
// nothing to connect to (signed out, or the job is gone).
function stream(where, listen) {
  const connect = () => {
    const events = new EventSource(where());
    listen(events);
    events.addEventListener("error", () => {
      if (events.readyState === EventSource.CLOSED) setTimeout(reconnect, RECONNECT_MS);
    });
  };
  const reconnect = async () => {
    let response = null; // none: the server itself does not answer
    const reading = new AbortController();
    try {
      response = await fetch(where(), { credentials: "same-origin", signal: reading.signal });
    } catch (error) {}
    reading.abort(); // its status is all this asks: the stream is the EventSource's
    if (response && (response.redirected || (response.status >= 400 && response.status < 500))) {
      disconnected(false); // signed out, or the job is gone: nothing to connect to
    } else if (response && response.ok) {
      connect();
    } else {
      setTimeout(reconnect, RECONNECT_MS);
    }
  };
  connect();
}

function live() {
  const source = document.body.dataset.liveEvents;
  if (!source) return;
  const regions = document.querySelectorAll("[data-live-src]");
  let busy = false;
  const update = async () => {
    if (busy) return;
    busy = true;
    try {
      await Promise.all([...regions].map(refresh));
    } finally {
      busy = false;
    }
  };
  stream(
    () => source,
    (events) => {
      events.onopen = () => {
        disconnected(false);
        update(); // what changed while the page was disconnected
      };
      events.onmessage = update;
      events.onerror = () => disconnected(true);
    },
  );
}

// A job's live output (docs/output.md), each chunk as it is written: a part per attempt, its
// text as it comes, a line per progress record and marker. A superseded marker strikes out
// what it covers (its attempt's output from its step on, and what that attempt wrote outside
// any step) and says so; the cut marker says the output reached its cap. The stream's "end"
// says the job has finished; a stream connected again starts after the last chunk shown.
function output() {
  const box = document.querySelector("[data-output-src]");
  if (!box) return;
  const state = box.querySelector(".output-state");
  let next = 0; // the offset after the last chunk shown
  const part = (attempt) => {
    let section = box.querySelector(`section[data-attempt="${attempt}"]`);
    if (!section) {
      section = document.createElement("section");
      section.className = "attempt";
      section.dataset.attempt = attempt;
      const title = document.createElement("h3");
      title.textContent = "Attempt " + attempt;
      section.append(title);
      box.insertBefore(section, state);
      box.hidden = false;
    }
    return section;
  };
  const line = (section, kind, text) => {
    const said = document.createElement("p");
    said.className = kind;
    said.textContent = text;
    section.append(said);
    return said;
  };
  const show = (event) => {
    const chunk = JSON.parse(event.data);
    next = chunk.offset + 1;
    const section = part(chunk.attempt);
    const step = chunk.step === null ? "" : String(chunk.step);
    if (chunk.kind === "text") {
      let said = section.lastElementChild;
      if (!said.classList.contains("said")) said = line(section, "said", "");
      const text = document.createElement("span");
      text.dataset.step = step;
      text.textContent = chunk.body;
      said.append(text);
    } else if (chunk.kind === "progress") {
      line(section, "progress", "progress " + JSON.stringify(chunk.body)).dataset.step = step;
    } else if (chunk.kind === "superseded") {
      for (const shown of section.querySelectorAll("[data-step]")) {
        const from = shown.dataset.step;
        if (from === "" || Number(from) >= chunk.body.step) shown.classList.add("superseded");
      }
      line(section, "marker", `Superseded from step ${chunk.body.step} on: the next attempt makes this output again`);
    } else if (chunk.kind === "cut") {
      line(section, "marker", `Cut: the job's output reached its cap of ${chunk.body.max_bytes} bytes; nothing more is kept`);
    }
  };
  stream(
    () => box.dataset.outputSrc + "?offset=" + next,
    (events) => {
      for (const kind of ["text", "progress", "superseded", "cut"]) {
        events.addEventListener(kind, show);
      }
      events.addEventListener("end", (event) => {
        events.close();
        const status = JSON.parse(event.data).status;
        state.textContent = `The job has finished (${status}): this is all of its output.`;
      });
    },
  );
}

document.addEventListener("DOMContentLoaded", () => {
  arm(document);
  tick();
  setInterval(tick, 1000);
  live();
  output();
});
