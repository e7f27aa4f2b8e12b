// pagedserve playground: chats streamed over SSE and a live map of the paged KV cache.
"use strict";

const KEY_STORE = "pagedserve.api_key";
const FAST_POLL_MS = 250;   // 4 Hz while anything runs
const SLOW_POLL_MS = 2000;
const MAX_CELLS = 16384;
const MAX_TABLE_CHIPS = 96;

const $ = (id) => document.getElementById(id);
let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let modelName = null;
let keyWaiters = [];

// -- API access -----------------------------------------------------------------------
async function api(path, opts = {}) {
  for (;;) {
    const headers = Object.assign({}, opts.headers || {});
    if (apiKey) headers["Authorization"] = "Bearer " + apiKey;
    const res = await fetch(path, Object.assign({}, opts, { headers }));
    if (res.status !== 401) return res;
    await askForKey(apiKey ? "That key was refused." : "");
  }
}

function askForKey(message) {
  $("key-error").textContent = message;
  const dlg = $("key-dialog");
  if (!dlg.open) dlg.showModal();
  $("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", () => {
  apiKey = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((w) => w());
});

// -- chats ----------------------------------------------------------------------------
const chats = [];
let current = null;

function newChat() {
  const chat = { id: chats.length + 1, history: [], ctrl: null, el: document.createElement("div") };
  chat.el.className = "chat";
  chat.el.dataset.chat = String(chat.id);
  $("chats").appendChild(chat.el);
  chat.tab = document.createElement("button");
  chat.tab.textContent = "chat " + chat.id;
  chat.tab.addEventListener("click", () => select(chat));
  $("tabs").insertBefore(chat.tab, $("new-chat"));
  chats.push(chat);
  select(chat);
  return chat;
}

function select(chat) {
  current = chat;
  for (const c of chats) {
    c.el.hidden = c !== chat;
    c.tab.classList.toggle("active", c === chat);
  }
  $("stop").disabled = !chat.ctrl;
  $("send").disabled = !!chat.ctrl;
  $("prompt").focus();
}

function addMessage(chat, role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  el.appendChild(body);
  chat.el.appendChild(el);
  $("chats").scrollTop = $("chats").scrollHeight;
  return el;
}

function setBusy(chat, ctrl) {
  chat.ctrl = ctrl;
  chat.tab.classList.toggle("busy", !!ctrl);
  if (chat === current) select(chat);
  schedulePoll(0);
}

async function send(chat, text) {
  const system = $("system-prompt").value;
  chat.history.push({ role: "user", content: text });
  addMessage(chat, "user", text);
  const msg = addMessage(chat, "assistant", "");
  const body = msg.querySelector(".text");
  const messages = (system ? [{ role: "system", content: system }] : []).concat(chat.history);
  const req = {
    model: modelName, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  const ctrl = new AbortController();
  setBusy(chat, ctrl);
  const t0 = performance.now();
  let tFirst = null, pieces = 0, usage = null, finish = null;
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(req), signal: ctrl.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || ("HTTP " + res.status));
    }
    for await (const event of sseEvents(res.body)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      if (choice.finish_reason) finish = choice.finish_reason;
      const thought = choice.delta && choice.delta.reasoning_content;
      if (thought) {  // a reasoning model's thinking (--reasoning-parser), shown apart
        let box = msg.querySelector(".thinking");
        if (!box) {
          box = document.createElement("span");
          box.className = "thinking";
          msg.insertBefore(box, body);
        }
        if (tFirst === null) tFirst = performance.now();
        box.textContent += thought;
      }
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (tFirst === null) tFirst = performance.now();
        pieces += 1;
        body.textContent += piece;
        msg.dataset.pieces = String(pieces);
        $("chats").scrollTop = $("chats").scrollHeight;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { msg.classList.add("error"); body.textContent += (body.textContent ? "\n" : "") + e.message; }
  }
  const tEnd = performance.now();
  chat.history.push({ role: "assistant", content: body.textContent });
  const tokens = usage ? usage.completion_tokens : pieces;
  const stats = document.createElement("span");
  stats.className = "stats";
  const parts = [];
  if (tFirst !== null) parts.push("TTFT " + Math.round(tFirst - t0) + " ms");
  if (tFirst !== null && tokens > 1 && tEnd > tFirst) {
    parts.push(((tokens - 1) / ((tEnd - tFirst) / 1000)).toFixed(1) + " tokens/s");
  }
  parts.push(tokens + " tokens");
  if (usage && usage.prompt_tokens_details) {
    parts.push(usage.prompt_tokens_details.cached_tokens + "/" + usage.prompt_tokens + " prompt tokens cached");
  }
  if (finish) parts.push(finish);
  stats.textContent = parts.join(" \u00b7 ");
  msg.appendChild(stats);
  msg.dataset.done = "1";
  setBusy(chat, null);
}

async function* sseEvents(stream) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || current.ctrl) return;
  $("prompt").value = "";
  send(current, text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (current.ctrl) current.ctrl.abort(); });
$("new-chat").addEventListener("click", () => newChat());

// -- the KV block map -------------------------------------------------------------------
let pollTimer = null;
let lastState = null;
let cellEls = [];
let lastCells = new Uint8Array(0);
let lastLoaded = new Uint8Array(0);
let blockInfo = [];  // per cell: {owners: [request ids], fill}

// Each live request gets the next hue of a golden-angle walk, so requests that run
// together get far-apart colours; the colours of finished requests are forgotten.
const colourOf = new Map();
let nextColour = 0;
function tint(id) {
  if (!colourOf.has(id)) colourOf.set(id, nextColour++);
  return "hsl(" + ((colourOf.get(id) * 137.508 + 210) % 360).toFixed(0) + " 65% 55%)";
}
function forgetColours(st) {
  const live = new Set(st.requests.map((r) => r.id));
  for (const id of colourOf.keys()) if (!live.has(id)) colourOf.delete(id);
}

function expandRuns(runs) {
  const out = [];
  for (const [first, count] of runs) for (let b = first; b < first + count; b++) out.push(b);
  return out;
}

function decodeCells(b64) {
  const raw = atob(b64);
  const cells = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) cells[i] = raw.charCodeAt(i);
  return cells;
}

function renderMap(st) {
  const cells = decodeCells(st.cells);
  const loaded = st.loaded_cells ? decodeCells(st.loaded_cells) : new Uint8Array(cells.length);
  lastCells = cells;
  lastLoaded = loaded;
  const grid = $("block-map");
  if (cellEls.length !== cells.length) {
    grid.textContent = "";
    grid.style.setProperty("--cell", cells.length <= 512 ? "18px" : cells.length <= 4096 ? "12px" : "6px");
    cellEls = [];
    for (let i = 0; i < cells.length; i++) {
      const el = document.createElement("i");
      el.dataset.cell = String(i);
      grid.appendChild(el);
      cellEls.push(el);
    }
  }
  const per = st.blocks_per_cell, bs = st.block_size;
  blockInfo = Array.from(cells, () => ({ owners: [], fill: 0 }));
  for (const r of st.requests) {
    if (!r.block_table) continue;
    expandRuns(r.block_table).forEach((b, pos) => {
      const info = blockInfo[Math.floor(b / per)];
      info.owners.push(r.id);
      info.fill = Math.max(info.fill, Math.min(bs, Math.max(0, r.num_computed_tokens - pos * bs)));
    });
  }
  cells.forEach((v, i) => {
    const el = cellEls[i], refs = v >> 1, owners = blockInfo[i].owners;
    const state = refs > 0 ? "used" : (v & 1 ? "cached" : "free");
    el.className = "blk " + state + (refs > 1 ? " shared" : "") + (loaded[i] ? " stored" : "");
    el.dataset.refs = String(refs);
    el.style.background = refs > 0 && owners.length ? tint(owners[0]) : "";
  });
  $("pool-info").textContent = st.num_blocks + " blocks of " + bs + " tokens" +
    (per > 1 ? " (" + per + " blocks per cell)" : "") +
    (st.prefix_caching ? ", prefix caching on" : ", prefix caching off");
}

function renderRequests(st) {
  const body = $("requests").querySelector("tbody");
  body.textContent = "";
  for (const r of st.requests) {
    const tr = document.createElement("tr");
    tr.dataset.request = r.id;
    const table = r.block_table ? expandRuns(r.block_table) : [];
    const shown = table.slice(0, MAX_TABLE_CHIPS).join(" ") +
      (table.length > MAX_TABLE_CHIPS ? " \u2026 (" + table.length + " blocks)" : "");
    const cols = ["", r.id, r.status, String(r.num_tokens), String(r.num_cached_tokens), shown];
    cols.forEach((text, i) => {
      const td = document.createElement("td");
      if (i === 0) {
        const sw = document.createElement("span");
        sw.className = "swatch";
        sw.style.background = tint(r.id);
        td.appendChild(sw);
      } else td.textContent = text;
      if (i === 2) td.className = "status";
      if (i === 5) td.className = "table";
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  $("no-requests").hidden = st.requests.length > 0;
}

function renderCounters(st) {
  const c = st.counters;
  const pct = (x) => (100 * x).toFixed(1) + "%";
  $("c-running").textContent = c.num_running;
  $("c-waiting").textContent = c.num_waiting;
  $("c-used").textContent = c.num_used_blocks;
  $("c-free").textContent = c.num_free_blocks;
  $("c-cached").textContent = c.num_cached_free_blocks;
  $("c-waste").textContent = pct(c.kv_waste);
  $("c-hits").textContent = pct(c.prefix_hit_rate);
  $("c-preempt").textContent = c.num_preemptions;
  if (lastState && st.time > lastState.time) {
    const dt = st.time - lastState.time;
    const dTok = c.generation_tokens_total - lastState.counters.generation_tokens_total;
    $("c-tps").textContent = (dTok / dt).toFixed(1);
  }
}

async function poll() {
  pollTimer = null;
  let busy = chats.some((c) => c.ctrl);
  try {
    const res = await api("/v1/kv_cache/state?max_cells=" + MAX_CELLS);
    if (res.ok) {
      const st = await res.json();
      renderMap(st);
      renderRequests(st);
      renderCounters(st);
      forgetColours(st);
      lastState = st;
      busy = busy || st.requests.length > 0;
      if (!busy) $("c-tps").textContent = "0";
    }
  } catch (e) { /* the server may be restarting: try again later */ }
  schedulePoll(busy ? FAST_POLL_MS : SLOW_POLL_MS);
}

function schedulePoll(ms) {
  if (pollTimer !== null) {
    if (ms > 0) return;
    clearTimeout(pollTimer);
  }
  pollTimer = setTimeout(poll, ms);
}

$("block-map").addEventListener("mousemove", (ev) => {
  const tip = $("tooltip");
  const i = ev.target.dataset ? ev.target.dataset.cell : undefined;
  if (i === undefined || !lastState) { tip.hidden = true; return; }
  const cell = Number(i), per = lastState.blocks_per_cell, el = cellEls[cell];
  const refs = Number(el.dataset.refs), info = blockInfo[cell];
  const cached = (lastCells[cell] & 1) === 1;
  const last = Math.min((cell + 1) * per, lastState.num_blocks) - 1;
  const lines = [per > 1 ? "blocks " + cell * per + "\u2013" + last : "block " + cell,
    "ref count " + refs, "owners " + (info.owners.join(", ") || "none"),
    "fill " + (refs > 0 ? info.fill : (cached ? lastState.block_size : 0)) + "/" + lastState.block_size + " tokens",
    "prefix-cached " + (cached ? "yes" : "no") + (lastLoaded[cell] ? ", read back from the KV store" : "")];
  tip.textContent = lines.join("\n");
  tip.hidden = false;
  tip.style.left = ev.clientX + 12 + "px";
  tip.style.top = ev.clientY + 12 + "px";
});
$("block-map").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });

// -- start ----------------------------------------------------------------------------
async function start() {
  newChat();
  const res = await api("/v1/models");
  const models = await res.json();
  modelName = models.data[0].id;
  $("model-name").textContent = modelName;
  document.body.dataset.ready = "1";
  schedulePoll(0);
}
start();
