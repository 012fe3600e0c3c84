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
  region.innerHTML = html;
  for (const id of opened) {
    const fold = document.getElementById(id);
    if (fold) fold.open = true;
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
  const connect = () => {
    const events = new EventSource(source);
    events.onopen = () => {
      disconnected(false);
      update(); // what changed while the page was disconnected
    };
    events.onmessage = update;
    events.onerror = () => {
      disconnected(true);
      // A stream that ended is connected again by the browser; one refused (503 while the
      // database is away) is not: this page tries again until it is taken.
      if (events.readyState === EventSource.CLOSED) setTimeout(reconnect, RECONNECT_MS);
    };
  };
  const reconnect = async () => {
    let response = null; // none: the server itself does not answer
    const reading = new AbortController();
    try {
      response = await fetch(source, { credentials: "same-origin", signal: reading.signal });
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

document.addEventListener("DOMContentLoaded", () => {
  arm(document);
  tick();
  setInterval(tick, 1000);
  live();
});
