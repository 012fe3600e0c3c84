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

async function refresh(region) {
  const response = await fetch(region.dataset.liveSrc, {
    credentials: "same-origin",
    headers: { accept: "text/html" },
  });
  if (response.redirected || !response.ok) return; // signed out, or the job is gone
  const focused = region.contains(document.activeElement) && document.activeElement.value;
  if (focused) return; // never replace a form someone is typing into
  if (region.querySelector("input[type=checkbox]:checked")) return; // nor rows someone chose
  // a fold someone opened stays open (each named by its id)
  const opened = [...region.querySelectorAll("details[id][open]")].map((d) => d.id);
  region.innerHTML = await response.text();
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

function live() {
  const source = document.body.dataset.liveEvents;
  if (!source) return;
  const regions = document.querySelectorAll("[data-live-src]");
  let busy = false;
  const events = new EventSource(source);
  events.onmessage = async () => {
    if (busy) return;
    busy = true;
    try {
      await Promise.all([...regions].map(refresh));
    } finally {
      busy = false;
    }
  };
}

document.addEventListener("DOMContentLoaded", () => {
  arm(document);
  tick();
  setInterval(tick, 1000);
  live();
});
