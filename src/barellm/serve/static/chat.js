// barellm's chat page: streams replies from /v1/chat/completions. Model text is only ever put into the
// page as text nodes (textContent); the small markdown subset below builds elements, never HTML strings.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];          // {role, content} of every finished turn, sent with each request
let controller = null;            // the AbortController of the reply being streamed

// --- a small, safe markdown subset: ``` fenced code blocks, `inline code`, **bold**, paragraphs ---------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function inline(parent, text) {
  // `code` and **bold**; everything else stays plain text
  const pattern = /`([^`\n]+)`|\*\*([^*\n]+)\*\*/g;
  let last = 0;
  for (const m of text.matchAll(pattern)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    parent.appendChild(m[1] !== undefined ? el("code", "", m[1]) : el("strong", "", m[2]));
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function render(text) {
  // A document fragment for text; an unclosed fence (a reply still streaming) is shown as code so far.
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [];
  const flush = () => {
    const body = para.join("\n").trim();
    if (body) { const p = el("p"); inline(p, body); out.appendChild(p); }
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const fence = lines[i].match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (!fence) {
      if (lines[i].trim() === "") flush(); else para.push(lines[i]);
      continue;
    }
    flush();
    const code = [];
    i++;
    while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
    const pre = el("pre");
    if (fence[1]) pre.appendChild(el("span", "lang", fence[1]));
    pre.appendChild(el("code", fence[1] ? "language-" + fence[1] : "", code.join("\n")));
    out.appendChild(pre);
  }
  flush();
  return out;
}

// --- the conversation ---------------------------------------------------------------------------

function addMessage(role, content) {
  $("empty")?.remove();
  const box = el("div", "message " + role);
  box.appendChild(el("div", "role", role));
  const body = el("div", "content");
  body.appendChild(render(content));
  box.appendChild(body);
  box.dataset.chunks = "0";
  $("conversation").appendChild(box);
  box.scrollIntoView({block: "end"});
  return box;
}

function show(box, text) {
  const body = box.querySelector(".content");
  body.replaceChildren(render(text));
  box.dataset.text = text;
  const pane = $("conversation");
  pane.scrollTop = pane.scrollHeight;
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("new-chat").disabled = busy;
}

function status(text) { $("status").textContent = text; }

async function errorText(response) {
  try { return (await response.json()).error.message; } catch { return response.statusText; }
}

async function send(text) {
  conversation.push({role: "user", content: text});
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.dataset.state = "streaming";
  const system = $("system").value.trim();
  const body = {
    messages: (system ? [{role: "system", content: system}] : []).concat(conversation),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    stream: true,
    stream_options: {include_usage: true},
  };
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  controller = new AbortController();
  setBusy(true);
  status("generating…");
  let reply = "";
  let usage = null;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal});
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const piece = chunk.choices?.[0]?.delta?.content;
          if (piece) {
            reply += piece;
            box.dataset.chunks = String(Number(box.dataset.chunks) + 1);
            show(box, reply);
          }
        }
      }
    }
    box.dataset.state = "done";
    const secs = (performance.now() - started) / 1000;
    status(usage ? `${usage.completion_tokens} tokens in ${secs.toFixed(1)} s` : "");
  } catch (err) {
    if (err.name === "AbortError") {
      box.dataset.state = "stopped";
      box.classList.add("stopped");
      status("stopped");
    } else {
      box.dataset.state = "error";
      box.classList.add("error");
      show(box, reply + (reply ? "\n\n" : "") + "Error: " + err.message);
      status("");
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  if (reply) conversation.push({role: "assistant", content: reply});
  else if (box.dataset.state !== "error") conversation.pop();   // nothing came back: the question can be asked again
}

async function loadModel() {
  const response = await fetch("/v1/models", {headers: headers()});
  if (response.ok) {
    const data = await response.json();
    const loaded = data.data.filter((m) => m.loaded !== false);   // the others load on first use
    $("model").textContent = (loaded.length ? loaded : data.data).map((m) => m.id).join(", ");
  } else {
    $("model").textContent = response.status === 401 ? "enter the API key in the settings" : await errorText(response);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  for (const [id, out] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
    $(id).addEventListener("input", () => { $(out).textContent = $(id).value; });
  }
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", () => {
    conversation.length = 0;
    const note = el("p", "muted", "New conversation.");
    note.id = "empty";
    $("conversation").replaceChildren(note);
    status("");
  });
  $("api-key").addEventListener("change", loadModel);
  loadModel();
});

window.barellmChat = {render, conversation};
