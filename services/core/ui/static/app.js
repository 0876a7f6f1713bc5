// Cairn's dashboard: plain JavaScript, no dependencies. Signed in through the identity
// provider, the session is core's HttpOnly cookie, and every call sends the session's CSRF
// token (the cairn_csrf cookie) as X-CSRF-Token. cron and dag take bearer tokens, not
// core's cookie: for them core mints a short-lived token bound to the session
// (POST /v1/login/token), which this page keeps in memory only, renews before it
// expires, and drops on sign-out. A pasted token stays in this tab's sessionStorage and
// goes, as a bearer token, to core's, cron's and dag's public APIs.
"use strict";

const CONFIG = JSON.parse(document.getElementById("cairn-config").textContent);
const BASES = { core: "", cron: CONFIG.cron.replace(/\/$/, ""), dag: CONFIG.dag.replace(/\/$/, "") };
const TOKEN_KEY = "cairn.token";
const TASK_STATES = ["ready", "waiting", "running", "succeeded", "failed", "dead", "cancelled"];
const NODE_STATES = ["pending", "ready", "waiting", "released", "mapped", "running", "succeeded", "failed",
  "upstream_failed", "skipped", "cancelling", "cancelled"];
const COLOURS = {
  pending: "#8a93a6", ready: "#8a93a6", queued: "#8a93a6", waiting: "#c98a12",
  released: "#c98a12", mapped: "#2f6fd6", running: "#2f6fd6", succeeded: "#2e9b4f", failed: "#e06b1f",
  upstream_failed: "#e06b1f", dead: "#c8312f", cancelled: "#5b5f6a", cancelling: "#5b5f6a",
  skipped: "#5b5f6a",
};
const SVG = "http://www.w3.org/2000/svg";

let pollers = [];
let aborts = [];
let me = null;

class ApiError extends Error {
  constructor(status, detail) { super(detail); this.status = status; }
}

const csrfToken = () => {
  const found = /(?:^|;\s*)cairn_csrf=([^;]*)/.exec(document.cookie);
  return found ? decodeURIComponent(found[1]) : null;
};
const token = () => sessionStorage.getItem(TOKEN_KEY);
const signedIn = () => Boolean(token() || csrfToken());
const authorization = () => token() ? { Authorization: `Bearer ${token()}` } : { "X-CSRF-Token": csrfToken() || "" };

// The session's bearer token for cron and dag: { token, expires } (ms), never stored.
let sessionBearer = null;
let minting = null;
const RENEW_MS = 60_000;

async function mintSessionBearer() {
  const answer = await fetch("/v1/login/token", { method: "POST", headers: { "X-CSRF-Token": csrfToken() || "" } });
  const data = await answer.json().catch(() => ({}));
  if (answer.status === 401) { logout(); throw new ApiError(401, "log in again"); }
  if (!answer.ok) throw new ApiError(answer.status, data.detail || answer.statusText);
  sessionBearer = { token: data.token, expires: Date.parse(data.expires_at) };
  return data.token;
}

// What goes to cron and dag: the pasted token, or the session's (renewed a minute before
// it expires; one request at a time however many pages ask).
async function bearerFor(renew = false) {
  if (token()) return token();
  if (!renew && sessionBearer && sessionBearer.expires - Date.now() > RENEW_MS) return sessionBearer.token;
  minting = minting || mintSessionBearer().finally(() => { minting = null; });
  return minting;
}

async function api(service, path, options = {}) {
  const headers = service === "core" ? authorization() : { Authorization: `Bearer ${await bearerFor()}` };
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  // a count over the whole backlog this old is good enough (core shares one reading)
  if (options.maxAge !== undefined) headers["Cache-Control"] = `max-age=${options.maxAge}`;
  const answer = await fetch(BASES[service] + path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  if (answer.status === 401 && service === "core" && !options.quiet) { logout(); throw new ApiError(401, "log in again"); }
  if (answer.status === 401 && service !== "core" && !token() && !options.retried) {
    await bearerFor(true);  // the session's token ended early (a key withdrawn): a new one, or sign in
    return api(service, path, { ...options, retried: true });
  }
  const type = answer.headers.get("content-type") || "";
  const data = type.includes("json") ? await answer.json() : await answer.text();
  if (!answer.ok) throw new ApiError(answer.status, (data && data.detail) || answer.statusText);
  return data;
}

// --- DOM helpers: text always goes in as text, never as markup ---

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) if (value !== null && value !== undefined) el.setAttribute(key, value);
  for (const child of children.flat()) if (child) el.append(child instanceof Node ? child : String(child));
  return el;
}

const badge = (state) => h("span", { class: `badge s-${state}`, "data-state": state }, state);
const ago = (iso) => iso ? `${Math.max(0, Math.round((Date.now() - Date.parse(iso)) / 1000))} s ago` : "—";
const when = (iso) => iso ? new Date(iso).toLocaleString() : "—";
const num = (value, digits = 0) => value === null || value === undefined ? "—" : Number(value).toFixed(digits);

function table(headers, rows) {
  return h("table", {},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", { class: /^[#0-9]|num$/.test(x) ? "num" : null }, x)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: headers.length, class: "muted" }, "nothing here"))));
}

// What the task last wrote to CAIRN_PROGRESS (docs/progress.md), and its stall bound.
function progressOf(task) {
  const p = task.progress;
  const bound = task.progress_timeout_s ? ` · ends after ${task.progress_timeout_s} s without progress` : "";
  if (!p || !p.updated_at) return `—${bound}`;
  const said = [p.fraction !== null ? `${Math.round(p.fraction * 100)}%` : "", p.message || ""].filter(Boolean).join(" ");
  const label = `${said || "(no message)"} · attempt ${p.attempt_id}, ${when(p.updated_at)}${bound}`;
  return p.fraction !== null ? bar(p.fraction, 1, label) : label;
}

function checkpointOf(task) {
  const p = task.progress;
  if (!p || p.checkpoint_bytes === null) return "—";
  return `${p.checkpoint_bytes} bytes from attempt ${p.checkpoint_attempt_id}, ${when(p.checkpoint_at)}`;
}

function bar(used, total, label) {
  const share = total > 0 ? Math.min(1, used / total) : 0;
  const el = h("span", { class: used > total ? "bar over" : "bar", title: label });
  const fill = h("span");
  fill.style.width = `${Math.round(share * 100)}%`;
  el.append(fill);
  return h("span", {}, el, " ", label);
}

function problem(error) {
  if (error.status === 403) return h("p", { class: "error" }, "Your role may not see this page.");
  return h("p", { class: "error" }, `Could not load: ${error.message}`);
}

const note = (el, text, error = false) => el.replaceChildren(h("span", { class: error ? "error" : "muted" }, text));

// A button that calls ``action``, says what came of it in ``message``, then redraws.
function actionButton(id, label, action, message, refresh, cls = null) {
  return h("button", { id, class: cls, type: "button", onclick: async () => {
    try { note(message, await action()); } catch (error) { note(message, error.message, true); }
    await refresh();
  } }, label);
}

// Run ``draw`` now and every two seconds while the page is shown; it fills ``box``,
// whose data-turn counts the refreshes (what changed shows without a reload).
async function live(box, draw) {
  let turns = 0;
  const turn = async () => {
    try { box.replaceChildren(await draw()); } catch (error) { box.replaceChildren(problem(error)); }
    box.dataset.turn = String(++turns);
  };
  pollers.push(setInterval(turn, 2000));
  await turn();
  return turn;
}

// --- pages ---

async function signInLink(form) {
  try {
    const answer = await fetch("/v1/login/config");
    if (!answer.ok) return;
    form.querySelector("h1").after(
      h("a", { id: "signin", class: "button primary", href: "/v1/login/start?next=/ui" }, "Sign in"),
      h("p", { class: "muted" }, "or with a token:"));
  } catch (error) { /* no sign-in here: the token form alone */ }
}

function loginPage(main) {
  const input = h("input", { id: "token", type: "password", autocomplete: "off", placeholder: "cairn_…" });
  const message = h("p", { class: "muted" }, "Paste a token from `cairn token create NAME`.");
  const submit = async (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    try {
      me = await api("core", "/v1/whoami", { quiet: true });
      showUser();
      location.hash = "#/tasks";
    } catch (error) {
      sessionStorage.removeItem(TOKEN_KEY);
      message.replaceChildren(h("span", { class: "error" }, error.status === 401 ? "Unknown or revoked token." : error.message));
    }
  };
  const form = h("form", { class: "login", onsubmit: submit },
    h("h1", {}, "Log in to Cairn"), h("label", { for: "token" }, "Token"), input,
    h("button", { id: "login", class: "primary", type: "submit" }, "Log in"), message);
  main.append(form);
  signInLink(form);
  input.focus();
}

// The secret an s3:// artifact is fetched with (docs/security.md, "Artifact credentials").
function artifactKeys(artifact) {
  const ref = artifact.credentials;
  if (!ref) return "";
  return ` · fetched with ${ref.team ? `${ref.team}/${ref.secret}` : ref.secret}`;
}

// A task's retry policy in one line: poison pill window and the causes it never or always retries.
function placementOf(placement) {
  if (!placement) return "any worker";
  const parts = [];
  if (placement.required.length) parts.push(`requires ${placement.required.join(", ")}`);
  for (const p of placement.preferred) parts.push(`prefers ${p.selector} (${p.weight})`);
  if (placement.spread) parts.push(`spread by ${placement.spread.by} (skew ${placement.spread.max_skew})`);
  if (placement.anti_affinity) parts.push(`one per ${placement.anti_affinity}`);
  return parts.join("; ") || "any worker";
}

function retryPolicy(retry) {
  const causes = (c) => [c.exit_codes.length ? `exit ${c.exit_codes.join(", ")}` : "",
    c.signals.length ? `signal ${c.signals.join(", ")}` : ""].filter(Boolean).join("; ");
  const parts = [`poison after ${retry.poison_after} crashes within ${num(retry.poison_window_s / 3600, 1)} h`];
  if (causes(retry.never)) parts.push(`never retried: ${causes(retry.never)}`);
  if (causes(retry.always)) parts.push(`always retried: ${causes(retry.always)}`);
  return parts.join(" · ");
}

async function queuesPage(main) {
  main.append(h("h1", {}, "Queues"));
  const box = h("div");
  main.append(box);
  // Each call counts the whole backlog. A count up to one refresh old (2 s), shared by
  // everyone watching through this core, does as well as one of this page's own; and
  // while counting takes long (a second or more: a backlog of millions), an older one, so
  // that the page keeps its counting to about a twentieth of the time: at most 60 s old.
  // Quicker calls keep 2 s: on a merely busy host the page stays live. What the calls
  // took is the slowest of the last 60 turns (2 minutes), failed ones included, as the
  // turns between two countings are quick (core answers them with the last count).
  let maxAge = 2;
  const took = [];
  await live(box, async () => {
    const counted = { maxAge };  // what this turn asks (turns overlap when calls are slow)
    const began = performance.now();
    let queues, history, owners;
    try {
      [queues, history, owners] = await Promise.all([api("core", "/v1/queues", counted),
        api("core", "/v1/queues/history?minutes=60", counted), api("core", "/v1/owners?limit=10", counted)]);
    } finally {
      took.push((performance.now() - began) / 1000);
      if (took.length > 60) took.shift();
      const slowest = Math.max(...took);
      maxAge = slowest < 1 ? 2 : Math.min(60, Math.ceil(20 * slowest));
    }
    const shared = counted.maxAge;
    const rows = queues.items.map((q) => h("tr", { "data-queue": q.name },
      h("td", {}, q.name, q.paused ? " (paused)" : ""),
      ["ready", "waiting", "running", "failed"].map((st) => h("td", { class: "num" }, q.depth[st] || 0)),
      h("td", { class: "num" }, q.depth.dead ? h("a", { href: `#/dead?queue=${encodeURIComponent(q.name)}` }, q.depth.dead) : 0),
      h("td", { class: "num" }, q.oldest_waiting_age_s === null ? "—" : `${num(q.oldest_waiting_age_s, 1)} s`),
      h("td", { class: "num" }, `${q.default_timeout_s ?? "—"} / ${q.max_timeout_s ?? "—"}`),
      h("td", { class: "num" }, q.max_wait_s === null ? "—" : `${q.max_wait_s} s`)));
    const cards = history.items.map((q) => h("div", { class: "card" }, h("h3", {}, q.name), chart(q)));
    const quota = (used, most) => (most === null ? num(used, 1) : `${num(used, 1)}/${num(most, 1)}`);
    const top = owners.items.map((o) => h("tr", { "data-owner": o.name },
      h("td", {}, o.name), h("td", { class: "num" }, `${num(o.share * 100, 1)}%`),
      h("td", { class: "num" }, quota(o.running.attempts, o.quota.max_running)),
      h("td", { class: "num" }, quota(o.running.cpu, o.quota.max_cpu)),
      h("td", { class: "num" }, quota(o.waiting, o.quota.max_waiting)),
      h("td", {}, o.at_quota.join(", ") || "—")));
    return h("div", {},
      table(["queue", "ready", "waiting", "running", "failed", "dead", "oldest waiting", "timeout s (default / max)", "max wait"], rows),
      shared > 2 ? h("p", { class: "muted" }, `Counting the backlog takes long: these counts may be up to ${shared} s old.`) : null,
      h("h2", {}, "Top owners"),
      top.length ? table(["owner", "share", "running", "cpu", "waiting", "at quota"], top)
        : h("p", { class: "muted" }, "Nothing running or waiting."),
      h("h2", {}, "Last hour"),
      h("p", { class: "muted" }, "Bars: tasks finished per minute; line: backlog (unfinished tasks)."),
      h("div", { class: "grid" }, cards.length ? cards : h("p", { class: "muted" }, "No activity in the last hour.")));
  });
}

function chart(series) {
  const width = 340, height = 120, pad = 24, n = series.backlog.length;
  const top = Math.max(1, ...series.backlog, ...series.finished, ...series.submitted);
  const x = (i) => pad + (i * (width - pad - 4)) / Math.max(1, n - 1);
  const y = (v) => height - pad + 4 - (v * (height - pad - 8)) / top;
  const bars = series.finished.map((v, i) => v ? s("rect", {
    x: x(i) - 2, y: y(v), width: 4, height: height - pad + 4 - y(v), fill: "#2e9b4f", opacity: 0.7,
  }, s("title", {}, `${n - i - 1} min ago: ${v} finished, ${series.submitted[i]} submitted`)) : null);
  const line = series.backlog.map((v, i) => `${i ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  return s("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, width, height, role: "img" },
    s("line", { class: "axis", x1: pad, y1: height - pad + 4, x2: width, y2: height - pad + 4 }),
    s("line", { class: "axis", x1: pad, y1: 4, x2: pad, y2: height - pad + 4 }),
    s("text", { x: 2, y: 12 }, String(top)), s("text", { x: 2, y: height - pad + 4 }, "0"),
    s("text", { x: pad, y: height - 4 }, "-60 min"), s("text", { x: width - 30, y: height - 4 }, "now"),
    bars, s("path", { d: line, stroke: "#2f6fd6", fill: "none", "stroke-width": 2 }));
}

const tasksPage = (main, params) => taskList(main, params, { title: "Tasks", verbs: ["retry", "cancel"] });
const deadPage = (main, params) => taskList(main, params, {
  title: "Dead set", state: "dead", verbs: ["retry"],
  intro: "Tasks whose attempts are spent or that could not run: retry them one by one from their page, or all that the filter selects here.",
});

// A filtered list of tasks, live, with bulk actions on what the filter selects. With
// ``options.state`` the list is that state's alone (the dead set).
async function taskList(main, params, options) {
  const path = options.state ? "#/dead" : "#/tasks";
  main.append(h("h1", {}, options.title));
  if (options.intro) main.append(h("p", { class: "muted" }, options.intro));
  const stateSelect = h("select", { name: "state", id: "filter-state" }, h("option", { value: "" }, "any"),
    TASK_STATES.map((st) => h("option", { value: st, selected: params.get("state") === st }, st)));
  const queueInput = h("input", { name: "queue", id: "filter-queue", value: params.get("queue") || "", size: 12 });
  const labelInput = h("input", { name: "label", id: "filter-label", value: params.get("label") || "", placeholder: "key=value", size: 16 });
  const ownerInput = h("input", { name: "owner", id: "filter-owner", value: params.get("owner") || "", placeholder: "every owner", size: 12 });
  const admin = me && me.role === "admin";
  const apply = (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    if (!options.state && stateSelect.value) next.set("state", stateSelect.value);
    if (queueInput.value) next.set("queue", queueInput.value);
    if (labelInput.value) next.set("label", labelInput.value);
    if (admin && ownerInput.value) next.set("owner", ownerInput.value);
    location.hash = `${path}?${next}`;
  };
  main.append(h("form", { class: "filters", onsubmit: apply },
    options.state ? null : h("label", {}, "state", stateSelect), h("label", {}, "queue", queueInput),
    h("label", {}, "label", labelInput), admin ? h("label", {}, "owner", ownerInput) : null,
    h("button", { type: "submit" }, "Filter")));
  const query = new URLSearchParams(params);
  if (!admin) query.delete("owner");
  if (options.state) query.set("state", options.state);
  main.append(bulkActions(selectorOf(query), options.verbs));
  const box = h("div", { id: "task-list" });
  main.append(box);
  query.set("limit", "100");
  await live(box, async () => {
    const page = await api("core", `/v1/tasks?${query}`);
    return table(["#", "name", "owner", "queue", "state", "attempts", "created", "last error"], page.items.map((t) =>
      h("tr", { "data-task-id": t.id },
        h("td", { class: "num" }, h("a", { href: `#/tasks/${t.id}` }, t.id)), h("td", {}, t.name),
        h("td", {}, t.owner), h("td", {}, t.queue), h("td", {}, badge(t.state)),
        h("td", { class: "num" }, t.attempts), h("td", {}, when(t.created_at)), h("td", { class: "muted" }, t.last_error || ""))));
  });
}

// The bulk API's filter (TaskSelector) from the list's query: the same tasks the list shows
// that the caller may act on (a user's own; an admin's, every owner's or the one named).
function selectorOf(query) {
  const selector = { labels: {} };
  for (const key of ["state", "queue", "owner"]) if (query.get(key)) selector[key] = query.get(key);
  for (const pair of query.getAll("label")) {
    const cut = pair.indexOf("=");
    if (cut > 0) selector.labels[pair.slice(0, cut)] = pair.slice(cut + 1);
  }
  return selector;
}

const BULK_LIMIT = 10000;  // MAX_BULK: the most one call moves
const DONE = { retry: "retried", cancel: "cancelled" };

// Retry or cancel what ``selector`` takes: a dry run counts them, the confirmation shows
// the count, and only its button makes the real calls, up to that count.
function bulkActions(selector, verbs) {
  const message = h("span", { id: "bulk-message" });
  const confirm = h("div", { id: "confirm", class: "confirm", hidden: true });
  const whose = () => me.role !== "admin" ? "of yours" : selector.owner ? `of ${selector.owner}` : "of every owner";
  const act = async (verb, count) => {
    confirm.hidden = true;
    let changed = 0;
    try {
      for (let turn = 0; changed < count && turn <= count / BULK_LIMIT + 1; turn++) {
        const body = { filter: selector, limit: Math.min(BULK_LIMIT, count - changed) };
        const done = await api("core", `/v1/tasks/${verb}`, { method: "POST", body });
        changed += done.changed;
        if (!done.more || !done.changed) break;
      }
      note(message, `${DONE[verb]} ${changed} task${changed === 1 ? "" : "s"}`);
    } catch (error) { note(message, `${DONE[verb]} ${changed}, then: ${error.message}`, true); }
  };
  const ask = (verb) => async () => {
    message.replaceChildren();
    let count;
    try {
      count = (await api("core", `/v1/tasks/${verb}`, { method: "POST", body: { filter: selector, dry_run: true } })).matched;
    } catch (error) { note(message, error.message, true); return; }
    const noun = `${count} task${count === 1 ? "" : "s"}`;
    confirm.dataset.count = String(count);
    confirm.replaceChildren(
      h("span", { id: "confirm-text" }, count ? `${verb === "retry" ? "Retry" : "Cancel"} ${noun} ${whose()}?` : `No task ${whose()} matches.`),
      count ? h("button", { id: "confirm-yes", class: "danger", type: "button", onclick: () => act(verb, count) }, `Yes, ${verb} ${noun}`) : null,
      h("button", { id: "confirm-no", type: "button", onclick: () => { confirm.hidden = true; } }, count ? "No" : "Close"));
    confirm.hidden = false;
  };
  const buttons = verbs.map((verb) => h("button", { id: `bulk-${verb}`, type: "button", onclick: ask(verb) },
    `${verb === "retry" ? "Retry" : "Cancel"} all matching…`));
  return h("div", { class: "bulk" }, h("div", { class: "actions" }, buttons, message), confirm);
}

async function taskPage(main, id) {
  const head = h("h1", {}, `Task ${id}`);
  const actions = h("div", { class: "actions" });
  const message = h("p");
  const box = h("div");
  const log = h("pre", { class: "log", id: "log" });
  const logStatus = h("p", { class: "muted", id: "log-status" }, "following…");
  main.append(head, actions, message, box, h("h2", {}, "Log"), logStatus, log);
  followLog(id, log, logStatus);
  let refresh = async () => {};
  const act = (verb) => async () => {
    try {
      await api("core", `/v1/tasks/${id}/${verb}`, { method: "POST" });
      message.replaceChildren(h("span", { class: "muted" }, `${verb} requested`));
    } catch (error) { message.replaceChildren(h("span", { class: "error" }, error.message)); }
    await refresh();
  };
  const cancel = h("button", { id: "cancel", class: "danger", type: "button", onclick: act("cancel") }, "Cancel");
  const retry = h("button", { id: "retry", type: "button", onclick: act("retry") }, "Retry");
  actions.append(cancel, retry);
  refresh = await live(box, async () => {
    const [task, attempts, events] = await Promise.all([
      api("core", `/v1/tasks/${id}`), api("core", `/v1/tasks/${id}/attempts`), api("core", `/v1/tasks/${id}/events`)]);
    const final = ["succeeded", "dead", "cancelled"].includes(task.state);
    cancel.disabled = final;
    retry.disabled = !["dead", "failed", "cancelled"].includes(task.state);
    const last = attempts.items[attempts.items.length - 1];
    const labels = Object.entries(task.labels);
    const run = task.labels["cairn.dag/run"];
    const schedule = task.labels["cairn.cron/schedule"];
    return h("div", {},
      h("dl", { class: "fields" },
        h("dt", {}, "state"), h("dd", { id: "task-state" }, badge(task.state)),
        h("dt", {}, "name"), h("dd", {}, task.name),
        h("dt", {}, "owner"), h("dd", {}, task.owner),
        h("dt", {}, "queue"), h("dd", {}, task.queue, ` · priority ${task.priority}`),
        h("dt", {}, "artifact"), h("dd", {}, task.artifact.uri, artifactKeys(task.artifact)),
        h("dt", {}, "args"), h("dd", {}, JSON.stringify(task.args)),
        h("dt", {}, "attempts"), h("dd", {}, `${task.attempts} of ${task.retry.max_attempts}`),
        h("dt", {}, "timeout"), h("dd", { id: "task-timeout" }, task.timeout_s === null ? "none" : `${task.timeout_s} s`),
        h("dt", {}, "start by"), h("dd", { id: "task-start-by" }, task.start_by ? when(task.start_by) : "—"),
        h("dt", {}, "retry policy"), h("dd", { id: "task-retry" }, retryPolicy(task.retry)),
        h("dt", {}, "progress"), h("dd", { id: "task-progress" }, progressOf(task)),
        h("dt", {}, "checkpoint"), h("dd", { id: "task-checkpoint" }, checkpointOf(task)),
        h("dt", {}, "last error"), h("dd", {}, task.last_error || "—"),
        h("dt", {}, "labels"), h("dd", {}, labels.length ? labels.map(([k, v]) => `${k}=${v}`).join(", ") : "—"),
        h("dt", {}, "placement"), h("dd", { id: "task-placement" }, placementOf(task.placement)),
        task.pending_reason ? [h("dt", {}, "waiting because"), h("dd", { id: "task-pending" }, task.pending_reason)] : null,
        run ? [h("dt", {}, "workflow run"), h("dd", {}, h("a", { href: `#/runs/${run}` }, `run ${run}`))] : null,
        schedule ? [h("dt", {}, "schedule"), h("dd", {}, h("a", { href: "#/schedules" }, `schedule ${schedule}`))] : null,
        h("dt", {}, "created"), h("dd", {}, when(task.created_at)),
        h("dt", {}, "finished"), h("dd", {}, when(task.finished_at))),
      h("h2", {}, "Resources: used against requested"),
      h("dl", { class: "fields" },
        h("dt", {}, "memory"), h("dd", {}, last && last.peak_memory_mb !== null
          ? bar(last.peak_memory_mb, task.resources.memory_mb, `${num(last.peak_memory_mb)} of ${task.resources.memory_mb} MB (peak)`)
          : `${task.resources.memory_mb} MB requested; not measured yet`),
        h("dt", {}, "cpu"), h("dd", {}, last && last.cpu_seconds !== null
          ? `${num(last.cpu_seconds, 2)} CPU s used; ${task.resources.cpu} CPU requested`
          : `${task.resources.cpu} CPU requested`)),
      h("h2", {}, "Attempts"),
      table(["#", "worker", "outcome", "exit", "peak MB", "CPU s", "started", "ended", "error"], attempts.items.map((a) =>
        h("tr", { "data-attempt-id": a.id }, h("td", { class: "num" }, a.number), h("td", {}, a.worker_id ?? "—"),
          h("td", {}, a.outcome || "running"), h("td", { class: "num" }, a.signal ? `signal ${a.signal}` : a.exit_code ?? "—"),
          h("td", { class: "num" }, num(a.peak_memory_mb)), h("td", { class: "num" }, num(a.cpu_seconds, 2)),
          h("td", {}, when(a.started_at)), h("td", {}, when(a.ended_at)), h("td", {}, a.error || "")))),
      h("h2", {}, "Events"),
      table(["seq", "op", "from", "to", "reason", "at"], events.items.map((e) =>
        h("tr", {}, h("td", { class: "num" }, e.seq), h("td", {}, e.op), h("td", {}, e.from_state || "—"),
          h("td", {}, badge(e.to_state)), h("td", {}, e.reason || ""), h("td", {}, when(e.at))))));
  });
}

// The task's log as it is written: the server-sent events of ?follow=true, read through
// fetch (EventSource cannot send the bearer token); each attempt in turn until the task ends.
async function followLog(id, pre, status) {
  const control = new AbortController();
  aborts.push(control);
  let attempt = null, offset = 0;
  while (!control.signal.aborted) {
    const query = new URLSearchParams({ follow: "true", offset: String(offset) });
    if (attempt !== null) query.set("attempt_id", attempt);
    let ended = null;
    try {
      const answer = await fetch(`/v1/tasks/${id}/logs?${query}`, { headers: authorization(), signal: control.signal });
      if (!answer.ok) throw new ApiError(answer.status, answer.statusText);
      const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (let next = await reader.read(); !next.done; next = await reader.read()) {
        buffer += next.value;
        for (let cut = buffer.indexOf("\n\n"); cut >= 0; cut = buffer.indexOf("\n\n")) {
          const frame = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const name = /^event: (.*)$/m.exec(frame), data = /^data: (.*)$/m.exec(frame);
          if (!name || !data) continue;
          const body = JSON.parse(data[1]);
          if (name[1] === "end") { ended = body; continue; }
          const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
          if (body.attempt_id !== attempt && pre.textContent) pre.append(`--- attempt ${body.attempt_id} ---\n`);
          pre.append(body.text);
          if (atEnd) pre.scrollTop = pre.scrollHeight;
          attempt = body.attempt_id;
          offset = body.next_offset;
          status.textContent = `attempt ${attempt}: running`;
        }
      }
    } catch (error) {
      if (control.signal.aborted) return;
      status.textContent = `log: ${error.message}; trying again`;
      await new Promise((done) => setTimeout(done, 2000));
      continue;
    }
    if (!ended) continue;  // the stream broke off: go on from where it stopped
    status.textContent = ended.attempt_id === null ? `no attempt; task ${ended.task_state}`
      : `attempt ${ended.attempt_id} ended: ${ended.outcome}; task ${ended.task_state}`;
    if (!pre.textContent) pre.textContent = "(no output)";
    if (["succeeded", "dead", "cancelled"].includes(ended.task_state) || ended.attempt_id === null) return;
    attempt = await nextAttempt(id, ended.attempt_id, control.signal);
    offset = 0;
    if (attempt === null) return;
  }
}

async function nextAttempt(id, after, signal) {
  while (!signal.aborted) {
    const attempts = await api("core", `/v1/tasks/${id}/attempts`);
    const newer = attempts.items.filter((a) => a.id > after);
    if (newer.length) return newer[0].id;
    const task = await api("core", `/v1/tasks/${id}`);
    if (["succeeded", "dead", "cancelled"].includes(task.state)) return null;
    await new Promise((done) => setTimeout(done, 1000));
  }
  return null;
}

async function workersPage(main) {
  main.append(h("h1", {}, "Workers"));
  const box = h("div");
  main.append(box);
  await live(box, async () => {
    const workers = await api("core", "/v1/workers");
    return table(["#", "host", "queues", "state", "cpu", "memory", "running", "heartbeat", "turn"],
      workers.items.filter((w) => w.state === "live" || w.state === "draining").map((w) =>
        h("tr", { "data-worker-id": w.id }, h("td", { class: "num" }, w.id), h("td", {}, w.hostname),
          h("td", {}, w.queues.join(", ")), h("td", {}, w.state),
          h("td", {}, bar(w.used_cpu, w.cpu, `${num(w.used_cpu, 1)} / ${num(w.cpu, 1)}`)),
          h("td", {}, bar(w.used_memory_mb, w.memory_mb, `${w.used_memory_mb} / ${w.memory_mb} MB`)),
          h("td", { class: "num" }, w.running), h("td", {}, ago(w.last_heartbeat_at)),
          h("td", { title: "the agent's last turn, as stored (rewritten once older than a quarter of the shorter liveness bound)" }, ago(w.last_turn_at)))));
  });
}

// What a month's ended attempts used (GET /v1/usage/accounts), by owner, team and queue:
// the API decides whose (an admin everyone's, a user their own and their teams').
const BY = [["owner", "By owner"], ["team", "By team (the tasks each team owns)"], ["queue", "By queue"]];
const thisMonth = () => new Date().toISOString().slice(0, 7);

async function usagePage(main, params) {
  const asked = params.get("month") || "";
  const month = /^\d{4}-(0[1-9]|1[0-2])$/.test(asked) ? asked : thisMonth();
  const picker = h("input", { type: "month", id: "usage-month", value: month, max: thisMonth(),
    onchange: (event) => { if (event.target.value) location.hash = `#/usage?month=${event.target.value}`; } });
  main.append(h("h1", {}, "Usage"),
    h("p", {}, h("label", { for: "usage-month" }, "Month (UTC) "), picker,
      h("span", { class: "muted" }, " · attempts that ended in it; rolled up every minute")));
  const box = h("div", { id: "usage" });
  main.append(box);
  await live(box, async () => {
    const found = await Promise.all(BY.map(([by]) =>
      api("core", `/v1/usage/accounts?month=${month}&by=${by}&limit=1000`)));
    return h("div", {}, BY.map(([by, title], i) => {
      const rows = found[i].items.map((a) => h("tr", { "data-key": a.key },
        h("td", {}, a.key), h("td", { class: "num" }, a.attempts),
        h("td", { class: "num", "data-cpu-s": a.cpu_s }, num(a.cpu_s, 1)),
        h("td", { class: "num", "data-cpu-reserved-s": a.cpu_reserved_s }, num(a.cpu_reserved_s, 1)),
        h("td", { class: "num", "data-memory-gb-s": a.memory_mb_s / 1024 }, num(a.memory_mb_s / 1024, 1)),
        h("td", { class: "num" }, num(a.wall_s, 1)), h("td", { class: "num" }, num(a.peak_memory_mb)),
        h("td", { class: "num", "data-device-s": JSON.stringify(a.device_s || {}) },
          Object.entries(a.device_s || {}).map(([name, s]) => `${name} ${num(s, 1)}`).join(", ") || "—")));
      return h("section", { id: `usage-${by}` }, h("h2", {}, title),
        table([by, "attempts", "CPU s used", "core-s reserved", "memory GB-s reserved", "wall s", "peak MB", "device s held"], rows));
    }));
  });
}

// The caller's services (GET /v1/services): revision, rollout, ready replicas of the
// current revision against the count, and where the ready ones listen (their endpoints).
async function servicesPage(main) {
  main.append(h("h1", {}, "Services"),
    h("p", { class: "muted" }, "Kept at N replicas by core's controller; ready replicas and where they listen."));
  const box = h("div", { id: "services" });
  main.append(box);
  await live(box, async () => {
    const found = await api("core", "/v1/services");
    const ends = await Promise.all(found.items.map((sv) =>
      api("core", `/v1/services/${encodeURIComponent(sv.name)}/endpoints`)));
    const rows = found.items.map((sv, i) => {
      const where = ends[i].items.filter((e) => e.owner === sv.owner)
        .flatMap((e) => Object.entries(e.endpoints).map(([port, at]) => `${port} ${at}`)).sort();
      return h("tr", { "data-service": sv.name },
        h("td", {}, sv.name), h("td", { class: "num" }, sv.revision),
        h("td", { "data-rollout": sv.rollout_state }, sv.rollout_state),
        h("td", { class: "num", "data-ready": sv.ready, "data-replicas": sv.replicas }, `${sv.ready} / ${sv.replicas}`),
        h("td", { class: "endpoints" }, where.length ? where.map((x) => h("div", {}, h("code", {}, x))) : "—"),
        h("td", {}, sv.message || ""));
    });
    return table(["name", "revision", "rollout", "ready / replicas", "endpoints", "message"], rows);
  });
}

async function schedulesPage(main) {
  main.append(h("h1", {}, "Schedules"), h("p", { class: "muted" }, "From the cron service; the next fires over the coming 24 hours."));
  const message = h("p", { id: "schedule-message" });
  const box = h("div");
  main.append(message, box);
  let refresh = async () => {};
  const post = (sc, verb) => async () => {
    const done = await api("cron", `/v1/schedules/${sc.id}/${verb}`, { method: "POST" });
    return verb === "trigger" ? `schedule ${sc.name} fired: ${done.outcome}${done.task_id ? `, task ${done.task_id}` : ""}${done.run_id ? `, run ${done.run_id}` : ""}`
      : `schedule ${sc.name} ${verb === "pause" ? "paused" : "resumed"}`;
  };
  refresh = await live(box, async () => {
    const page = await api("cron", "/v1/schedules?limit=50");
    const nexts = await Promise.all(page.items.map((sc) => sc.paused ? { items: [] } : api("cron", `/v1/schedules/${sc.id}/next?n=50`)));
    const rows = page.items.map((sc, i) => h("tr", { "data-schedule-id": sc.id, "data-paused": sc.paused ? "true" : "false" },
      h("td", { class: "num" }, sc.id), h("td", {}, sc.name), h("td", {}, h("code", {}, sc.expression)),
      h("td", {}, sc.timezone), h("td", {}, sc.target.kind === "dag" ? `run of ${sc.target.workflow}` : "task"),
      h("td", {}, sc.paused ? "paused" : when(sc.next_fire_at)), h("td", {}, timeline(nexts[i].items)),
      h("td", { class: "actions" },
        sc.paused ? actionButton(`resume-${sc.id}`, "Resume", post(sc, "resume"), message, () => refresh())
          : actionButton(`pause-${sc.id}`, "Pause", post(sc, "pause"), message, () => refresh()),
        actionButton(`trigger-${sc.id}`, "Trigger now", post(sc, "trigger"), message, () => refresh()))));
    return table(["#", "name", "expression", "zone", "target", "next fire", "next 24 h", "actions"], rows);
  });
}

function timeline(fires) {
  const width = 360, height = 28, start = Date.now(), span = 24 * 3600 * 1000;
  const x = (t) => 4 + ((t - start) * (width - 8)) / span;
  const marks = fires.map((f) => Date.parse(f.utc)).filter((t) => t - start <= span).map((t) =>
    s("circle", { class: "fire", cx: x(t).toFixed(1), cy: 12, r: 3, fill: "#2f6fd6" }, s("title", {}, new Date(t).toLocaleString())));
  const ticks = [0, 6, 12, 18, 24].map((hour) => s("text", { x: Math.min(width - 22, x(start + hour * 3600000)), y: 27 }, `+${hour}h`));
  return s("svg", { class: "timeline", viewBox: `0 0 ${width} ${height}`, width, height },
    s("line", { class: "axis", x1: 4, y1: 12, x2: width - 4, y2: 12 }), marks, ticks);
}

const RUN_LIVE = ["queued", "running"];
const RUN_RETRIED = ["failed", "cancelled"];

// A run's actions, as the DAG service allows them: cancel while it is queued or running,
// retry once it failed or was cancelled (with ``instances: failed`` only a mapped node's
// failed instances run again).
function runActions(run, message, refresh, failedInstances = false) {
  const post = (verb, body, said) => async () => {
    const done = await api("dag", `/v1/runs/${run.id}/${verb}`, { method: "POST", body });
    return `run ${run.id} ${said}: ${done.state}`;
  };
  return [
    RUN_LIVE.includes(run.state) ? actionButton(`cancel-run-${run.id}`, "Cancel", post("cancel", undefined, "cancelled"), message, refresh, "danger") : null,
    RUN_RETRIED.includes(run.state) ? actionButton(`retry-run-${run.id}`, "Retry", post("retry", undefined, "retried"), message, refresh) : null,
    RUN_RETRIED.includes(run.state) && failedInstances ? actionButton(`retry-instances-${run.id}`, "Retry failed instances",
      post("retry", { instances: "failed" }, "retried (failed instances)"), message, refresh) : null,
  ];
}

async function runsPage(main) {
  main.append(h("h1", {}, "Workflow runs"));
  const message = h("p", { id: "run-message" });
  const box = h("div");
  main.append(message, box);
  let refresh = async () => {};
  refresh = await live(box, async () => {
    const page = await api("dag", "/v1/runs?limit=100");
    return table(["#", "workflow", "version", "owner", "state", "created", "finished", "actions"], page.items.map((r) =>
      h("tr", { "data-run-id": r.id }, h("td", { class: "num" }, h("a", { href: `#/runs/${r.id}` }, r.id)),
        h("td", {}, h("a", { href: historyLink(r.workflow, r.owner), title: "run history" }, r.workflow)),
        h("td", { class: "num" }, r.workflow_version), h("td", {}, r.owner),
        h("td", {}, badge(r.state)), h("td", {}, when(r.created_at)), h("td", {}, when(r.finished_at)),
        h("td", { class: "actions" }, runActions(r, message, () => refresh())))));
  });
}

async function runPage(main, id) {
  main.append(h("h1", {}, `Run ${id}`));
  const message = h("p", { id: "run-message" });
  const box = h("div", { id: "run" });
  main.append(message, box);
  let refresh = async () => {};
  refresh = await live(box, async () => {
    const [run, graph] = await Promise.all([api("dag", `/v1/runs/${id}`), api("dag", `/v1/runs/${id}/graph`)]);
    const instances = new Map();
    for (const n of run.nodes) if (n.map_of) (instances.get(n.map_of) || instances.set(n.map_of, []).get(n.map_of)).push(n);
    const failedInstances = run.nodes.some((n) => n.map_of && ["failed", "upstream_failed", "cancelled"].includes(n.state));
    return h("div", {},
      h("p", { id: "run-state" }, h("a", { href: historyLink(run.workflow, run.owner), title: "run history" }, run.workflow),
        ` v${run.workflow_version} · `, badge(run.state), ` · started ${when(run.started_at)}`,
        run.deadline ? ` · deadline ${when(run.deadline)}` : "", run.reason ? ` · ${run.reason}` : "",
        run.parent_run_id ? h("span", { id: "run-parent" }, " · sub-workflow of ",
          h("a", { href: `#/runs/${run.parent_run_id}` }, `run ${run.parent_run_id}`), ` (node ${run.parent_node})`) : ""),
      h("div", { class: "actions" }, runActions(run, message, () => refresh(), failedInstances)),
      drawGraph(graph, instances),
      h("div", { class: "legend" }, NODE_STATES.map(badge)),
      h("h2", {}, "Nodes"),
      nodeTable(run.nodes, (n) => gateActions(run, n, message, () => refresh())));
  });
}

const historyLink = (workflow, owner) => `#/workflows/${encodeURIComponent(workflow)}/history?owner=${encodeURIComponent(owner)}`;

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)}s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)}m`;
  return `${(seconds / 3600).toFixed(1)}h`;
}

// A workflow's recent runs (columns, oldest left) by node (rows): each cell coloured by
// the node's state, its duration on it and in its title, so a slow or flaky node shows.
async function historyPage(main, encoded, params) {
  const name = decodeURIComponent(encoded);
  const limit = Math.min(100, Math.max(1, Number(params.get("limit")) || 25));
  const owner = params.get("owner");
  main.append(h("h1", {}, `Run history: ${name}`));
  const box = h("div", { id: "history" });
  main.append(box);
  await live(box, async () => {
    const query = new URLSearchParams({ limit: String(limit), ...(owner ? { owner } : {}) });
    const grid = await api("dag", `/v1/workflows/${encodeURIComponent(name)}/history?${query}`);
    if (!grid.runs.length) return h("p", { class: "muted" }, "No runs yet.");
    const head = h("tr", {}, h("th", {}, "node"), grid.runs.map((r) =>
      h("th", { class: "run-col", "data-run-id": r.id, title: `run ${r.id}: ${r.state}, v${r.workflow_version}, ${when(r.created_at)}` },
        h("a", { href: `#/runs/${r.id}` }, r.id), h("div", { class: `run-mark s-${r.state}` }))));
    const rows = grid.nodes.map((node) => h("tr", { "data-node-row": node }, h("th", {}, node), grid.runs.map((r) => {
      const c = r.nodes[node];
      if (!c) return h("td", { class: "cell none", title: `${node}: not in v${r.workflow_version}` });
      const took = c.duration_s === null ? "not started" : `${duration(c.duration_s)} (${c.duration_s.toFixed(3)} s)`;
      return h("td", { class: `cell s-${c.state}`, "data-run-id": r.id, "data-state": c.state,
        title: `${node} in run ${r.id}: ${c.state}, ${took}${c.try_number > 1 ? `, try ${c.try_number}` : ""}` }, duration(c.duration_s));
    })));
    return h("div", {}, h("table", { class: "history" }, h("thead", {}, head), h("tbody", {}, rows)),
      h("div", { class: "legend" }, NODE_STATES.map(badge)));
  });
}

const gateComments = new Map();

// An approval gate that waits: approve or reject it, with an optional comment (the
// DAG service says 403 to someone who is not its approver, 409 once it was decided).
// An event node only says what it waits for (`cairn dag signal` delivers it).
function gateActions(run, n, message, refresh) {
  if (n.event) return n.state === "waiting" ? `waits for event ${n.event}` : "";
  if (n.state !== "waiting" || n.decision) return n.decision ? `${n.decision}d by ${n.decided_by || "its timeout"}${n.comment ? `: ${n.comment}` : ""}` : "";
  const key = `${run.id}/${n.name}`;  // what was typed outlives the page's redraws
  const comment = h("input", { id: `gate-comment-${n.name}`, placeholder: "comment", maxlength: 2000,
    value: gateComments.get(key) || "", oninput: (event) => gateComments.set(key, event.target.value) });
  const post = (verb) => async () => {
    await api("dag", `/v1/runs/${run.id}/nodes/${encodeURIComponent(n.name)}/${verb}`, { method: "POST", body: { comment: comment.value } });
    return `${n.name} ${verb}d`;
  };
  return h("span", { class: "actions" }, comment,
    actionButton(`approve-${n.name}`, "Approve", post("approve"), message, refresh),
    actionButton(`reject-${n.name}`, "Reject", post("reject"), message, refresh, "danger"));
}

// Every node in order, each mapped node followed by its instances (indented, with the
// item each got), with the outputs each kept and why it failed or was skipped (a false
// ``when``: "when is false: ..."); a sub-workflow node links its child run.
function nodeTable(nodes, gate = () => "") {
  const shown = (value) => typeof value === "string" ? value : JSON.stringify(value);
  const outputs = (kept) => kept && Object.keys(kept).length
    ? h("dl", { class: "outputs" }, Object.entries(kept).map(([key, value]) => [h("dt", {}, key), h("dd", {}, shown(value))])) : "—";
  return table(["node", "state", "try", "task", "map item", "outputs", "error or reason", "approval or event"], nodes.map((n) =>
    h("tr", { "data-node-row": n.name, "data-map-of": n.map_of, class: n.map_of ? "instance" : null },
      h("td", {}, n.map_of ? `↳ ${n.name}` : n.name), h("td", {}, badge(n.state)), h("td", { class: "num" }, n.try_number),
      h("td", {}, n.task_id ? h("a", { href: `#/tasks/${n.task_id}` }, n.task_id)
        : n.child_run_id ? h("a", { href: `#/runs/${n.child_run_id}`, class: "child-run" }, `run ${n.child_run_id}`) : "—"),
      h("td", {}, n.map_of ? shown(n.map_item) : ""), h("td", { class: "node-outputs" }, outputs(n.outputs)),
      h("td", { class: "muted node-reason" }, n.error || ""), h("td", { class: "node-gate" }, gate(n)))));
}

// Layered layout: a node's layer is its longest path from a root; within a layer, nodes
// keep the order the API gave. Edges are drawn upstream (left) to downstream (right).
function drawGraph(graph, instances = new Map()) {
  const upstream = new Map(graph.nodes.map((n) => [n.name, []]));
  for (const e of graph.edges) upstream.get(e.target).push(e.source);
  const depth = new Map();
  const depthOf = (name) => {
    if (!depth.has(name)) {
      depth.set(name, 0);
      depth.set(name, Math.max(0, ...upstream.get(name).map((up) => depthOf(up) + 1)));
    }
    return depth.get(name);
  };
  const layers = [];
  for (const n of graph.nodes) (layers[depthOf(n.name)] ||= []).push(n);
  const boxW = 130, boxH = 30, gapX = 60, gapY = 16;
  const where = new Map();
  layers.forEach((layer, i) => layer.forEach((n, j) => where.set(n.name, { x: 10 + i * (boxW + gapX), y: 10 + j * (boxH + gapY) })));
  const width = 20 + layers.length * (boxW + gapX) - gapX;
  const height = 20 + Math.max(...layers.map((l) => l.length)) * (boxH + gapY) - gapY;
  const edges = graph.edges.map((e) => {
    const a = where.get(e.source), b = where.get(e.target);
    const x1 = a.x + boxW, y1 = a.y + boxH / 2, x2 = b.x, y2 = b.y + boxH / 2, mid = (x1 + x2) / 2;
    return s("path", { class: "edge", d: `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`, "marker-end": "url(#arrow)" });
  });
  const nodes = graph.nodes.map((n) => {
    const p = where.get(n.name);
    const mine = instances.get(n.name) || [];
    const ok = mine.filter((i) => i.state === "succeeded").length;
    const count = mine.length ? ` ${ok}/${mine.length}` : "";
    const room = 16 - count.length;
    const label = (n.name.length > room ? `${n.name.slice(0, room - 1)}…` : n.name) + count;
    const group = s("g", { class: "node", "data-node": n.name, "data-state": n.state, "data-instances": mine.length || null,
      transform: `translate(${p.x},${p.y})` },
      s("title", {}, `${n.name}: ${n.state}${n.task_id ? ` (task ${n.task_id})` : ""}${mine.length ? `; ${ok} of ${mine.length} instances succeeded` : ""}`),
      s("rect", { width: boxW, height: boxH, fill: COLOURS[n.state] || "#889" }),
      s("text", { x: 8, y: 19 }, label));
    if (n.task_id) group.addEventListener("click", () => { location.hash = `#/tasks/${n.task_id}`; });
    return group;
  });
  const defs = s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto" },
    s("path", { d: "M0,0 L10,5 L0,10 z", fill: "#8a93a6" })));
  return s("svg", { id: "run-graph", class: "graph", viewBox: `0 0 ${width} ${height}`, width, height }, defs, edges, nodes);
}

// --- routing ---

const ROUTES = [
  [/^#\/queues$/, queuesPage], [/^#\/tasks$/, tasksPage], [/^#\/tasks\/(\d+)$/, taskPage],
  [/^#\/dead$/, deadPage],
  [/^#\/workers$/, workersPage], [/^#\/usage$/, usagePage], [/^#\/services$/, servicesPage], [/^#\/schedules$/, schedulesPage], [/^#\/runs$/, runsPage],
  [/^#\/runs\/(\d+)$/, runPage], [/^#\/workflows\/([a-z0-9][a-z0-9_.%-]*)\/history$/, historyPage],
];

function showUser() {
  document.getElementById("whoami").textContent = me ? `${me.name} (${me.role})` : "";
  document.getElementById("logout").hidden = !me;
  document.getElementById("nav").hidden = !me;
}

async function signOut() {
  if (!token() && csrfToken()) {
    await fetch("/v1/login/logout", { method: "POST", headers: authorization() }).catch(() => null);
  }
  logout();
}

function logout() {
  sessionStorage.removeItem(TOKEN_KEY);
  sessionBearer = null;
  me = null;
  showUser();
  location.hash = "#/login";
}

async function route() {
  pollers.forEach(clearInterval);
  pollers = [];
  aborts.forEach((control) => control.abort());
  aborts = [];
  const main = document.getElementById("main");
  main.replaceChildren();
  if (!signedIn()) { showUser(); loginPage(main); return; }
  if (!me) {
    try { me = await api("core", "/v1/whoami", { quiet: true }); } catch (error) {
      if (error.status === 401) { me = null; showUser(); loginPage(main); } else main.append(problem(error));
      return;
    }
    showUser();
  }
  const [path, query] = location.hash.split("?");
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", path.startsWith(a.getAttribute("href")));
  for (const [pattern, page] of ROUTES) {
    const found = pattern.exec(path);
    if (found) {
      await page(main, found[1] ?? new URLSearchParams(query || ""), new URLSearchParams(query || ""));
      return;
    }
  }
  location.hash = "#/tasks";
}

document.getElementById("logout").addEventListener("click", signOut);
window.addEventListener("hashchange", route);
route();
