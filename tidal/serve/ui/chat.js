// The chat page: a conversation over the server's own /v1/chat/completions stream.
// Model text only ever reaches the DOM as text nodes (markdown.js builds the nodes). A reply ends
// one of four ways, each shown on the turn: finished ([DONE]), stopped (the fetch is aborted, so
// the server sees the disconnect and frees the request), an error event or HTTP error, or a
// connection that closed without [DONE].
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const md = window.tidalMarkdown;
  const KEY_STORE = "tidal-api-key";
  const METRICS_EVERY_MS = 2000;

  const state = {
    model: null,
    history: [],  // OpenAI messages sent with the next request (the system prompt is added then)
    busy: null,  // {ctl: AbortController} while a reply streams
  };

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function authHeaders(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = $("api-key").value.trim();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  function notice(text) {
    const n = $("notice");
    n.textContent = text || "";
    n.hidden = !text;
  }

  function askForKey() {
    notice("This server needs an API key: enter it under Settings (it is kept in this tab only).");
    document.body.classList.add("settings-open");
    $("api-key").focus();
  }

  async function errorText(res) {
    const raw = await res.text().catch(() => "");
    try {
      const body = JSON.parse(raw);
      const err = body.error || body;
      return `HTTP ${res.status}: ${err.message || JSON.stringify(err)}`;
    } catch {
      return `HTTP ${res.status}: ${raw.slice(0, 300) || res.statusText}`;
    }
  }

  async function loadModel() {
    try {
      const res = await fetch("/v1/models", { headers: authHeaders(false) });
      if (res.status === 401) return askForKey();
      if (!res.ok) return notice(await errorText(res));
      const body = await res.json();
      state.model = body.data[0].id;
      $("model-name").textContent = state.model;
      $("model-name").title = body.data[0].max_model_len ? `context ${body.data[0].max_model_len} tokens` : "";
      notice("");
    } catch (e) {
      $("model-name").textContent = "server unreachable";
      notice("Cannot reach the server: " + e.message);
    }
  }

  // ---- the request --------------------------------------------------------------------------

  function parseJSONField(id, kind) {
    const text = $(id).value.trim();
    if (!text) return undefined;
    let value;
    try {
      value = JSON.parse(text);
    } catch (e) {
      throw new Error(`${$(id).closest("label").firstChild.textContent.trim()}: not JSON (${e.message})`);
    }
    const ok = kind === "list" ? Array.isArray(value) : value !== null && typeof value === "object" && !Array.isArray(value);
    if (!ok) throw new Error(`${$(id).closest("label").firstChild.textContent.trim()}: must be a JSON ${kind}`);
    return value;
  }

  function buildRequest() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history);
    const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true } };
    const effort = $("effort").value;
    if (effort) body.reasoning_effort = effort;
    const temperature = $("temperature").value.trim();
    if (temperature !== "") body.temperature = Number(temperature);
    const maxTokens = $("max-tokens").value.trim();
    if (maxTokens !== "") body.max_tokens = parseInt(maxTokens, 10);
    const tools = parseJSONField("tools", "list");
    if (tools && tools.length) body.tools = tools;
    const extra = parseJSONField("extra", "object");
    if (extra) Object.assign(body, extra);
    return body;
  }

  // ---- the conversation view ------------------------------------------------------------------

  const messagesBox = () => $("messages");

  function nearBottom() {
    const c = $("conversation");
    return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
  }

  function scrollDown(force) {
    const c = $("conversation");
    if (force || nearBottom()) c.scrollTop = c.scrollHeight;
  }

  function userView(text, role) {
    const art = el("article", "msg " + (role || "user"));
    art.appendChild(el("div", "who", role === "tool" ? "tool result" : "you"));
    const body = el("div", "content plain", text);
    art.appendChild(body);
    messagesBox().appendChild(art);
    scrollDown(true);
    return art;
  }

  function assistantView() {
    const art = el("article", "msg assistant streaming");
    art.appendChild(el("div", "who", state.model || "assistant"));
    const reasoning = el("details", "reasoning");
    reasoning.open = true;
    reasoning.hidden = true;
    const summary = el("summary", "", "Thinking…");
    const reasoningBody = el("div", "reasoning-body");
    reasoning.append(summary, reasoningBody);
    summary.addEventListener("click", () => { view.userToggled = true; });
    const content = el("div", "content");
    const tools = el("div", "tool-calls");
    const meta = el("div", "turn-meta");
    art.append(reasoning, content, tools, meta);
    messagesBox().appendChild(art);
    const view = { art, reasoning, summary, reasoningBody, content, tools, meta, userToggled: false, pending: false };
    scrollDown(true);
    return view;
  }

  function prettyArguments(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch {
      return text;  // still streaming, or not JSON: as written
    }
  }

  function toolCard(call, turn, view) {
    const card = el("div", "tool-call");
    const head = el("div", "tool-head");
    head.append(el("span", "tool-label", "tool call"), el("span", "tool-name", call.name || "?"));
    card.append(head, el("pre", "tool-args", prettyArguments(call.arguments)));
    if (turn.done && !turn.error && !turn.stopped && call.id) {
      const form = el("div", "tool-result");
      const input = el("textarea");
      input.rows = 1;
      input.placeholder = "result to send back (optional)";
      const button = el("button", "", "Send result");
      button.type = "button";
      button.addEventListener("click", () => sendToolResult(call, input.value, form, turn));
      form.append(input, button);
      card.appendChild(form);
    }
    return card;
  }

  function paint(turn, view) {
    if (turn.reasoning) {
      view.reasoning.hidden = false;
      view.reasoningBody.textContent = turn.reasoning;
      const thinking = !turn.done && !turn.content && !turn.calls.length;
      view.summary.textContent = thinking ? "Thinking…" : `Thought (${turn.reasoningTime || "…"})`;
      if (!thinking && !view.userToggled) view.reasoning.open = false;
    }
    view.content.replaceChildren(md.render(turn.content));
    view.tools.replaceChildren(...turn.calls.filter(Boolean).map((c) => toolCard(c, turn, view)));
    const s = turnStats(turn);
    const parts = [];
    if (s.ttft !== null) parts.push(`TTFT ${fmtMs(s.ttft)}`);
    if (s.tps !== null) parts.push(`${s.tps.toFixed(1)} tok/s`);
    if (turn.usage) {
      const details = turn.usage.completion_tokens_details;
      const thinking = details && details.reasoning_tokens ? ` (${details.reasoning_tokens} thinking)` : "";
      parts.push(`${turn.usage.completion_tokens} tokens${thinking}`);
    }
    if (turn.finish) parts.push(`finish: ${turn.finish}`);
    if (turn.stopped) parts.push("stopped");
    view.meta.textContent = parts.join(" · ");
    if (turn.error) {
      const err = el("div", "error turn-error", turn.error);
      view.meta.appendChild(err);
    }
    view.art.classList.toggle("streaming", !turn.done);
    showStats(s, turn);
    scrollDown(false);
  }

  function schedulePaint(turn, view) {
    if (view.pending) return;
    view.pending = true;
    setTimeout(() => {
      view.pending = false;
      if (!turn.done) paint(turn, view);  // once done, the final paint has run (and the cards hold input)
    }, 33);
  }

  // ---- stats ----------------------------------------------------------------------------------

  function fmtMs(ms) {
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  // TTFT from the request to the first token's text; tokens/s over the decode span (the first
  // token's time excluded), from usage once it arrives, else from the chunks counted so far.
  function turnStats(turn) {
    const ttft = turn.tFirst === null ? null : turn.tFirst - turn.t0;
    let tps = null;
    if (turn.tFirst !== null && turn.tLast > turn.tFirst) {
      const n = turn.usage ? turn.usage.completion_tokens : turn.chunks;
      if (n > 1) tps = (n - 1) / ((turn.tLast - turn.tFirst) / 1000);
    }
    return { ttft, tps };
  }

  function showStats(s, turn) {
    $("stat-ttft").textContent = s.ttft === null ? "TTFT –" : `TTFT ${fmtMs(s.ttft)}`;
    $("stat-tps").textContent = s.tps === null ? "– tok/s" : `${s.tps.toFixed(1)} tok/s`;
    const u = turn.usage;
    if (u) {
      $("stat-tokens").textContent = `tokens ${u.prompt_tokens} in · ${u.completion_tokens} out`;
      const cached = u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : null;
      $("stat-cached").textContent = cached === null || cached === undefined
        ? "cached –" : `cached ${cached} / ${u.prompt_tokens}`;
    }
  }

  function parseMetrics(text) {
    const out = {};
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = /^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
      if (m && !(m[1] in out)) out[m[1]] = Number(m[3]);
    }
    return out;
  }

  async function pollMetrics() {
    try {
      const res = await fetch("/metrics", { headers: authHeaders(false) });
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      const m = parseMetrics(await res.text());
      const pct = (v) => (v === undefined ? "?" : `${(100 * v).toFixed(1)}%`);
      const pool = m["tidal:pool_usage_perc"];
      const held = m["tidal:kv_cache_usage_perc"];
      const running = m["tidal:num_requests_running"];
      const waiting = m["tidal:num_requests_waiting"];
      const pill = $("stat-pool");
      pill.textContent = `pool ${pct(pool)} (requests ${pct(held)}) · running ${running ?? "?"} · waiting ${waiting ?? "?"}`;
      pill.dataset.running = String(running ?? "");
    } catch (e) {
      $("stat-pool").textContent = "pool – (" + e.message + ")";
    }
  }

  // ---- streaming --------------------------------------------------------------------------------

  function onChunk(chunk, turn, view) {
    if (chunk.usage) turn.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const d = choice.delta || {};
      const now = performance.now();
      let got = false;
      const reasoning = typeof d.reasoning_content === "string" ? d.reasoning_content : d.reasoning;
      if (typeof reasoning === "string" && reasoning) {
        turn.reasoning += reasoning;
        got = true;
      }
      if (typeof d.content === "string" && d.content) {
        if (turn.reasoning && !turn.content && !turn.reasoningTime) turn.reasoningTime = fmtMs(now - turn.tFirst);
        turn.content += d.content;
        got = true;
      }
      for (const tc of Array.isArray(d.tool_calls) ? d.tool_calls : []) {
        const i = Number.isInteger(tc.index) ? tc.index : turn.calls.length;
        const call = (turn.calls[i] = turn.calls[i] || { id: "", name: "", arguments: "" });
        if (tc.id) call.id = tc.id;
        const f = tc.function || {};
        if (typeof f.name === "string") call.name += f.name;
        if (typeof f.arguments === "string") call.arguments += f.arguments;
        got = true;
      }
      if (choice.finish_reason) turn.finish = choice.finish_reason;
      if (got) {
        if (turn.tFirst === null) turn.tFirst = now;
        turn.tLast = now;
        turn.chunks++;
      }
    }
    schedulePaint(turn, view);
  }

  // One SSE event's data: false once [DONE] arrived.
  function onEvent(data, turn, view) {
    if (data === "[DONE]") return false;
    let obj;
    try {
      obj = JSON.parse(data);
    } catch {
      turn.error = "the server sent an event that is not JSON: " + data.slice(0, 200);
      return true;
    }
    if (obj && obj.error) {
      const e = obj.error;
      turn.error = "the server ended the reply with an error: " + (e.message || JSON.stringify(e));
    } else if (obj) {
      onChunk(obj, turn, view);
    }
    return true;
  }

  async function readStream(res, turn, view) {
    const reader = res.body.getReader();
    // Stream mode: a character whose UTF-8 bytes are split across reads waits for the rest.
    const decoder = new TextDecoder("utf-8");
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
      let m;
      while ((m = /\r?\n\r?\n/.exec(buf))) {
        const event = buf.slice(0, m.index);
        buf = buf.slice(m.index + m[0].length);
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data && !onEvent(data, turn, view)) {
          turn.finished = true;
          reader.cancel().catch(() => {});
          return;
        }
      }
      if (done) break;
    }
    if (buf.trim().startsWith("data:")) onEvent(buf.trim().slice(5).trim(), turn, view);
    if (!turn.error) turn.error = "the connection closed before the reply finished (the server went away?)";
  }

  async function runTurn() {
    let body;
    try {
      body = buildRequest();
      $("settings-error").hidden = true;
    } catch (e) {
      $("settings-error").textContent = e.message;
      $("settings-error").hidden = false;
      document.body.classList.add("settings-open");
      return false;
    }
    const view = assistantView();
    const turn = {
      reasoning: "", content: "", calls: [], finish: null, usage: null, error: null, stopped: false,
      done: false, finished: false, t0: performance.now(), tFirst: null, tLast: null, chunks: 0, reasoningTime: null,
    };
    showStats({ ttft: null, tps: null }, { usage: { prompt_tokens: "–", completion_tokens: "–" } });  // clear the last reply's
    const ctl = new AbortController();
    state.busy = { ctl };
    setBusy(true);
    try {
      const res = await fetch("/v1/chat/completions", {
        method: "POST", headers: authHeaders(true), body: JSON.stringify(body), signal: ctl.signal,
      });
      if (!res.ok) {
        turn.error = await errorText(res);
        if (res.status === 401) askForKey();
      } else {
        await readStream(res, turn, view);
      }
    } catch (e) {
      if (ctl.signal.aborted) turn.stopped = true;
      else turn.error = "connection lost: " + e.message;
    }
    turn.done = true;
    if (turn.reasoning && !turn.reasoningTime && turn.tFirst !== null) turn.reasoningTime = fmtMs(turn.tLast - turn.tFirst);
    const produced = turn.content || turn.reasoning || turn.calls.length;
    if (produced) {
      const msg = { role: "assistant", content: turn.content };
      if (turn.reasoning) msg.reasoning_content = turn.reasoning;
      const calls = turn.calls.filter((c) => c && c.name);
      if (calls.length) {
        msg.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
      }
      state.history.push(msg);
      turn.pendingResults = new Set(calls.map((c) => c.id));
    } else {
      view.art.classList.add("excluded");
    }
    paint(turn, view);
    state.busy = null;
    setBusy(false);
    pollMetrics();
    return !!produced;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.classList.toggle("busy", busy);
  }

  async function sendUser(text) {
    if (state.busy || !text.trim()) return;
    if (!state.model) await loadModel();
    if (!state.model) return;
    state.history.push({ role: "user", content: text });
    const art = userView(text, "user");
    $("prompt").value = "";
    if (!(await runTurn())) {
      // Nothing came back: take the message out of the history so the next one is not doubled.
      state.history.pop();
      art.classList.add("excluded");
    }
  }

  // A tool result for one call of the last reply; once every call has one, the model answers.
  async function sendToolResult(call, text, form, turn) {
    if (state.busy) return;
    state.history.push({ role: "tool", tool_call_id: call.id, content: text });
    form.replaceChildren(el("div", "content plain", "result sent: " + (text || "(empty)")));
    turn.pendingResults.delete(call.id);
    if (turn.pendingResults.size === 0) await runTurn();
  }

  function stop() {
    if (state.busy) state.busy.ctl.abort();
  }

  function newChat() {
    stop();
    state.history = [];
    messagesBox().replaceChildren();
    $("prompt").focus();
  }

  function init() {
    const key = $("api-key");
    key.value = sessionStorage.getItem(KEY_STORE) || "";
    key.addEventListener("change", () => {
      sessionStorage.setItem(KEY_STORE, key.value.trim());
      loadModel();
    });
    $("settings-form").addEventListener("submit", (e) => e.preventDefault());  // Enter in a field sends nothing
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      sendUser($("prompt").value);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        sendUser($("prompt").value);
      }
    });
    document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", newChat);
    $("toggle-settings").addEventListener("click", () => document.body.classList.toggle("settings-open"));
    loadModel();
    pollMetrics();
    setInterval(() => { if (!document.hidden) pollMetrics(); }, METRICS_EVERY_MS);
    $("prompt").focus();
  }

  init();
})();
