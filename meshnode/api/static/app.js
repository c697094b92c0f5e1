// meshnode dashboard: polls this node's /v1/mesh every second and renders it; the chat box
// streams from /v1/chat/completions. Plain JS, no dependencies. Every figure comes from the node.
"use strict";

const KEY_STORE = "meshnode-api-key";
const COLORS = ["#2f6fde", "#1f9d55", "#c98a00", "#8e44ad", "#d64545", "#16a2b8"];
const $ = (id) => document.getElementById(id);
let model = null;
let chatHistory = [];  // the chat so far: [{role, content}]

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "style") Object.assign(node.style, v);
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

function askForKey() {
  $("key-panel").hidden = false;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key-input").value);
  $("key-input").value = "";
  $("key-panel").hidden = true;
  poll();
});

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], {hour12: false});
}

function showError(text) {
  $("error").hidden = !text;
  $("error").textContent = text || "";
}

// ---------------------------------------------------------------- rendering /v1/mesh
function stagesOf(plan) {
  const by = new Map();
  for (const stage of (plan && plan.stages) || []) {
    for (const id of stage.nodes) {
      if (!by.has(id)) by.set(id, []);
      by.get(id).push(stage);
    }
  }
  return by;
}

function renderHeader(mesh) {
  model = mesh.model;
  $("model").textContent = mesh.model || "";
  $("self").textContent = mesh.node_id;
  $("epoch").textContent = mesh.epoch;
  $("coordinator").textContent = mesh.coordinator || "–";
  const health = $("health");
  const unreachable = (mesh.unreachable || []).length;
  health.textContent = mesh.healthy ? (unreachable ? "serving · peers unreachable" : "serving")
    : (mesh.plan_error ? "model does not fit" : "not serving yet");
  health.className = "badge " + (mesh.healthy ? (unreachable ? "warn" : "ok") : "bad");
  document.title = "meshnode · " + mesh.node_id;
}

// Peers that mDNS announces but that never answer this node (meshnode/control/reachability.py).
function renderUnreachable(mesh) {
  const peers = mesh.unreachable || [];
  const box = $("unreachable");
  box.hidden = !peers.length;
  if (!peers.length) { box.replaceChildren(); return; }
  box.replaceChildren(
    ...peers.map((p) => el("div", {"data-node": p.node_id}, el("b", {}, p.node_id),
      ` is announced over mDNS but does not answer at ${p.address} (for ${Math.round(p.seconds)} s: ${p.error})`)),
    el("div", {class: "muted"}, "On macOS, a per-user service needs Local Network access on both machines " +
      "(System Settings > Privacy & Security > Local Network: the entry for Python, meshnode's interpreter), " +
      "then a restart of the service; a system service (sudo meshnode install --system) is exempt. On Linux, " +
      "check that the firewall lets in the peer's gRPC port (TCP 8471 by default)."));
}

function renderNodes(mesh) {
  const stages = stagesOf(mesh.plan);
  const body = $("nodes").tBodies[0];
  body.replaceChildren(...mesh.nodes.map((n) => {
    const held = stages.get(n.node_id) || [];
    const roles = [];
    if (n.node_id === mesh.coordinator) roles.push("coordinator");
    roles.push(held.length ? "stage" : "idle");
    const layers = held.map((s) => `${s.start_layer}–${s.end_layer - 1}`).join(", ") || "–";
    return el("tr", {"data-node": n.node_id},
      el("td", {}, el("b", {}, n.node_id), n.node_id === mesh.node_id ? el("span", {class: "muted"}, " (this node)") : null,
        el("div", {class: "muted"}, n.address ? `${n.address}:${n.http_port}` : "")),
      el("td", {}, ...roles.map((r) => el("span", {class: "role role-" + r}, r))),
      el("td", {}, bytes(n.memory_budget)),
      el("td", {}, bytes(n.total_memory)),
      el("td", {class: "layers"}, layers),
      el("td", {class: "muted"}, n.version || ""));
  }));
}

function renderPlan(mesh) {
  const plan = mesh.plan;
  const box = $("plan");
  if (!plan || !plan.stages.length) {
    box.replaceChildren(el("p", {class: "muted"}, mesh.plan_error ? "no plan: " + mesh.plan_error : "no plan yet"));
    $("plan-summary").textContent = "";
    $("plan-reason").textContent = "";
    return;
  }
  const total = Math.max(...plan.stages.map((s) => s.end_layer));
  const stages = stagesOf(plan);
  const ids = mesh.nodes.map((n) => n.node_id);
  for (const id of stages.keys()) if (!ids.includes(id)) ids.push(id);
  box.replaceChildren(...ids.map((id) => {
    const track = el("div", {class: "track"});
    for (const s of stages.get(id) || []) {
      const i = plan.stages.indexOf(s);
      const n = s.end_layer - s.start_layer;
      track.append(el("div", {
        class: "stage", "data-node": id, "data-layers": n,
        title: `layers ${s.start_layer}–${s.end_layer - 1}` + (s.nodes.length > 1 ? ` shared by ${s.nodes.join(", ")}` : ""),
        style: {left: (100 * s.start_layer / total) + "%", width: (100 * n / total) + "%",
                background: COLORS[i % COLORS.length]},
      }, `${s.start_layer}–${s.end_layer - 1} · ${n} layers`));
    }
    return el("div", {class: "plan-row"}, el("div", {class: "who"}, id), track);
  }));
  $("plan-summary").textContent = `· epoch ${plan.epoch} · ${plan.strategy} · ${plan.stages.length} stage(s) · ${total} layers` +
    (plan.max_context ? ` · context ${plan.max_context.toLocaleString("en-US")} tokens` : "");
  $("plan-reason").textContent = plan.reason || "";
}

// Several models on one mesh: each model's state and plan, and which one the chat talks to.
function renderModels(mesh) {
  const models = mesh.models || [];
  $("models-card").hidden = models.length < 2;
  $("chat-model-label").hidden = models.length < 2;
  $("models").replaceChildren(...models.map((m) => {
    const stages = ((m.plan && m.plan.stages) || [])
      .map((s) => `${s.start_layer}–${s.end_layer - 1}@${s.nodes.join("+")}`).join(" | ");
    const detail = stages || (m.plan && m.plan.reason) || m.plan_error || "";
    return el("li", {"data-model": m.model, "data-state": m.state},
              el("strong", {}, m.model), ` · ${m.state}` + (m.offered_here ? " · offered here" : "") +
              (detail ? ` · ${detail}` : ""));
  }));
  const select = $("chat-model");
  const ids = models.map((m) => m.model);
  if ([...select.options].map((o) => o.value).join() !== ids.join()) {
    const chosen = select.value;
    select.replaceChildren(...ids.map((id) => el("option", {value: id}, id)));
    if (ids.includes(chosen)) select.value = chosen;
  }
}

function renderProgress(mesh) {
  const p = mesh.progress;
  $("progress-card").hidden = !p;
  if (!p) return;
  $("progress-task").textContent = p.task;
  $("progress-bar").style.width = (p.total ? 100 * p.done / p.total : 0) + "%";
  $("progress-count").textContent = `${p.done} / ${p.total}`;
}

function renderLive(mesh) {
  $("measuring").hidden = !mesh.measuring;
  $("measuring").textContent = mesh.measuring
    ? `Measuring ${mesh.measuring}: requests run slower until it ends (once per model and machine).` : "";
  const m = mesh.metrics;
  if (!m) return;
  $("tps").textContent = m.tokens_per_second.toFixed(1);
  $("last-tps").textContent = m.last_request_tokens_per_second.toFixed(1);
  $("tokens").textContent = m.tokens_generated;
  $("ttft").textContent = m.mean_time_to_first_token === null ? "–" : (1000 * m.mean_time_to_first_token).toFixed(0) + " ms";
  const r = m.requests || {};
  const failed = (r.client_error || 0) + (r.unavailable || 0) + (r.error || 0) + (r.cancelled || 0);
  $("requests").textContent = `${r.ok || 0} / ${failed}`;
  const s = m.speculation || {};
  $("spec-accept").textContent = s.acceptance_rate == null ? "–" : (100 * s.acceptance_rate).toFixed(0) + " %";
  $("spec-per-pass").textContent = s.tokens_per_pass == null ? "–" : s.tokens_per_pass.toFixed(2);
  $("spec-cancelled").textContent = s.passes ? String(s.cancelled) : "–";
}

function renderLinks(mesh) {
  const rows = [];
  for (const n of mesh.nodes) {
    for (const link of n.links || []) {
      rows.push(el("tr", {},
        el("td", {}, n.node_id), el("td", {}, link.peer), el("td", {}, link.address || ""),
        el("td", {}, link.rtt_us !== undefined ? (link.rtt_us / 1000).toFixed(2) + " ms" : "–"),
        el("td", {}, link.jitter_us !== undefined ? (link.jitter_us / 1000).toFixed(2) + " ms" : "–"),
        el("td", {}, link.bandwidth ? bytes(link.bandwidth) + "/s" : "–")));
    }
  }
  $("links").tBodies[0].replaceChildren(...rows);
  $("links").hidden = !rows.length;
  $("links-none").hidden = !!rows.length;
}

function renderEvents(mesh) {
  const events = (mesh.events || []).slice().reverse();
  $("events").replaceChildren(...events.map((e) => {
    const rest = Object.entries(e).filter(([k]) => k !== "time" && k !== "event")
      .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
    return el("li", {}, el("span", {class: "when"}, clock(e.time)), el("span", {class: "kind " + e.event}, e.event), rest);
  }));
  if (!events.length) $("events").append(el("li", {class: "muted"}, "none yet"));
}

async function poll() {
  try {
    const r = await fetch("/v1/mesh", {headers: authHeaders(), cache: "no-store"});
    if (r.status === 401) { askForKey(); showError("this node needs an API key"); return; }
    if (!r.ok) throw new Error(`/v1/mesh answered ${r.status}`);
    const mesh = await r.json();
    showError("");
    renderHeader(mesh);
    renderUnreachable(mesh);
    renderNodes(mesh);
    renderPlan(mesh);
    renderModels(mesh);
    renderProgress(mesh);
    renderLive(mesh);
    renderLinks(mesh);
    renderEvents(mesh);
  } catch (err) {
    showError("cannot reach this node: " + err.message);
    $("health").textContent = "unreachable";
    $("health").className = "badge bad";
  }
}

async function loop() {
  await poll();
  setTimeout(loop, 1000);
}

// ---------------------------------------------------------------- chat (streamed SSE)
function addTurn(role, text) {
  const span = el("span", {class: "text"}, text);
  const turn = el("div", {class: "turn " + role}, el("span", {class: "who"}, role === "user" ? "you" : "model"), span);
  $("transcript").append(turn);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return span;
}

async function chat(prompt) {
  const status = $("chat-status");
  const send = $("chat-send");
  chatHistory.push({role: "user", content: prompt});
  addTurn("user", prompt);
  const out = addTurn("assistant", "");
  out.parentNode.setAttribute("data-state", "streaming");
  send.disabled = true;
  status.textContent = "streaming…";
  let text = "", chunks = 0, finish = null, failure = null;
  const started = performance.now();
  try {
    const body = {model: $("chat-model").value || model, messages: chatHistory, stream: true,
                  max_tokens: parseInt($("chat-max-tokens").value, 10) || 64,
                  temperature: parseFloat($("chat-temperature").value)};
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders({"Content-Type": "application/json"}), body: JSON.stringify(body)});
    if (r.status === 401) askForKey();
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${r.status}`);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", done = false;
    while (!done) {
      const {value, done: end} = await reader.read();
      if (end) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") { done = true; break; }
          const obj = JSON.parse(data);
          if (obj.error) { failure = obj.error.message; continue; }
          for (const choice of obj.choices || []) {
            if (choice.delta && choice.delta.content) {
              text += choice.delta.content;
              chunks += 1;
              out.textContent = text;
              status.textContent = `streaming… ${chunks} chunks`;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    }
    if (failure) throw new Error(failure);
    chatHistory.push({role: "assistant", content: text});
    const secs = (performance.now() - started) / 1000;
    status.textContent = `done: ${chunks} chunks in ${secs.toFixed(1)} s (finish: ${finish})`;
    out.parentNode.setAttribute("data-state", "done");
  } catch (err) {
    chatHistory.pop();
    status.textContent = "failed: " + err.message;
    out.parentNode.setAttribute("data-state", "failed");
  } finally {
    send.disabled = false;
  }
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const prompt = $("chat-input").value.trim();
  if (!prompt || $("chat-send").disabled) return;
  $("chat-input").value = "";
  chat(prompt);
});
$("chat-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("chat-clear").addEventListener("click", () => { chatHistory = []; $("transcript").replaceChildren(); $("chat-status").textContent = ""; });

loop();
