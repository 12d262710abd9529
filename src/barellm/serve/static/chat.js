// barellm's chat page: streams replies from /v1/chat/completions, from the model picked in the header. A
// reasoning model's reasoning (delta.reasoning_content) streams into a dimmed "Reasoning" block above the
// answer, open while the model thinks and collapsed once the answer starts (a click opens it again).
// Model text is only ever put into the page as text nodes (textContent); the Markdown renderer below builds
// elements, never HTML strings.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];          // {role, content} of every finished turn, sent with each request
let controller = null;            // the AbortController of the reply being streamed

// --- Markdown, built as elements (never HTML strings) ---------------------------------------------
// Blocks: headings, paragraphs, lists (nested by indentation), tables, quotes, rules and ``` fenced code
// (highlighted, with a copy button; an unclosed fence, a reply still streaming, is code so far). Inline:
// `code`, **bold**, *italic*, [links](https://...) and bare https:// addresses; a link that is not
// http(s) or mailto stays text.

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function safeHref(url) {
  return /^(https?:\/\/|mailto:)/i.test(url) ? url : null;
}

function link(text, url) {
  const a = el("a");
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  inline(a, text);
  return a;
}

function inline(parent, text) {
  const pattern = /`([^`\n]+)`|\*\*(?=\S)([^\n]*?\S)\*\*|(?<![\w*])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?![\w*])|\[([^\]\n]+)\]\(([^)\s]+)\)|(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"])/g;
  let last = 0;
  for (const m of text.matchAll(pattern)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) parent.appendChild(el("code", "", m[1]));
    else if (m[2] !== undefined) { const b = el("strong"); inline(b, m[2]); parent.appendChild(b); }
    else if (m[3] !== undefined) { const i = el("em"); inline(i, m[3]); parent.appendChild(i); }
    else if (m[4] !== undefined) {
      const href = safeHref(m[5]);
      parent.appendChild(href ? link(m[4], href) : document.createTextNode(m[0]));
    } else parent.appendChild(link(m[6], m[6]));
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

const KEYWORDS = new Set(("and as assert async await break case catch class const continue def default del do " +
  "elif else enum except export extends false False finally fn for from func function if impl import in " +
  "interface is lambda let match mut new nil None not null or package pass pub raise return self static " +
  "struct super switch this throw true True try type use var void while with yield").split(" "));
const HASH_COMMENTS = new Set(["python", "py", "sh", "bash", "shell", "zsh", "ruby", "rb", "yaml", "yml",
                               "toml", "r", "perl", "dockerfile", "makefile", "ini", "conf"]);

function highlight(code, language) {
  // spans of keywords, strings, numbers and comments; the text is the code's, character for character
  const out = document.createDocumentFragment();
  const lang = (language || "").toLowerCase();
  const comment = HASH_COMMENTS.has(lang) ? "#[^\\n]*" : lang ? "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?\\*\\/"
                                                          : "#[^\\n]*|\\/\\/[^\\n]*";
  const pattern = new RegExp(`(${comment})|("(?:[^"\\\\\\n]|\\\\.)*"?|'(?:[^'\\\\\\n]|\\\\.)*'?)` +
                             `|(\\b\\d[\\d_]*(?:\\.\\d+)?\\b)|([A-Za-z_]\\w*)`, "g");
  let last = 0;
  for (const m of code.matchAll(pattern)) {
    const kind = m[1] ? "tok-com" : m[2] ? "tok-str" : m[3] ? "tok-num" : KEYWORDS.has(m[4]) ? "tok-kw" : null;
    if (!kind) continue;
    if (m.index > last) out.appendChild(document.createTextNode(code.slice(last, m.index)));
    out.appendChild(el("span", kind, m[0]));
    last = m.index + m[0].length;
  }
  if (last < code.length) out.appendChild(document.createTextNode(code.slice(last)));
  return out;
}

function copyButton(text) {
  // text: the string to copy, or a function giving it when clicked (a reply still growing)
  const button = el("button", "copy", "Copy");
  button.type = "button";
  button.title = "copy to the clipboard";
  button.addEventListener("click", async () => {
    const value = typeof text === "function" ? text() : text;
    try {
      await navigator.clipboard.writeText(value);
    } catch {   // no clipboard API (a page not served from localhost or https): the old way
      const area = el("textarea");
      area.value = value;
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  return button;
}

const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function table(lines) {
  const t = el("table");
  const align = cells(lines[1]).map((c) => c.startsWith(":") && c.endsWith(":") ? "center"
                                           : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
  const head = el("thead");
  const row = el("tr");
  cells(lines[0]).forEach((c, i) => { const th = el("th"); th.style.textAlign = align[i] || ""; inline(th, c);
                                      row.appendChild(th); });
  head.appendChild(row);
  t.appendChild(head);
  const body = el("tbody");
  for (const line of lines.slice(2)) {
    const tr = el("tr");
    cells(line).forEach((c, i) => { const td = el("td"); td.style.textAlign = align[i] || ""; inline(td, c);
                                    tr.appendChild(td); });
    body.appendChild(tr);
  }
  t.appendChild(body);
  return t;
}

function list(lines) {
  // lines: consecutive list items (and their continuation lines); deeper indentation nests
  const root = {indent: -1, node: null, children: []};
  const stack = [root];
  let item = null;
  for (const line of lines) {
    const m = line.match(LIST_ITEM);
    if (!m) { if (item) item.text += " " + line.trim(); continue; }
    const indent = m[1].replace(/\t/g, "    ").length;
    while (stack.length > 1 && indent <= stack[stack.length - 1].indent) stack.pop();
    const parent = stack[stack.length - 1];
    const ordered = /\d/.test(m[2]);
    let group = parent.children[parent.children.length - 1];
    if (!group || group.ordered !== ordered || group.closed) {
      group = {ordered, start: ordered ? parseInt(m[2], 10) : 1, items: []};
      parent.children.push(group);
    }
    item = {indent, text: m[3], children: []};
    group.items.push(item);
    stack.push(item);
  }
  const build = (groups) => groups.map((g) => {
    const node = el(g.ordered ? "ol" : "ul");
    if (g.ordered && g.start !== 1) node.start = g.start;
    for (const it of g.items) {
      const li = el("li");
      inline(li, it.text);
      for (const sub of build(it.children)) li.appendChild(sub);
      node.appendChild(li);
    }
    return node;
  });
  return build(root.children);
}

function render(text) {
  // A document fragment for the Markdown text.
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [];
  const flush = () => {
    const body = para.join("\n").trim();
    if (body) { const p = el("p"); inline(p, body); out.appendChild(p); }
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (fence) {
      flush();
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
      const pre = el("pre");
      const source = code.join("\n");
      pre.appendChild(copyButton(source));
      if (fence[1]) pre.appendChild(el("span", "lang", fence[1]));
      const c = el("code", fence[1] ? "language-" + fence[1] : "");
      c.appendChild(highlight(source, fence[1]));
      pre.appendChild(c);
      out.appendChild(pre);
      continue;
    }
    const heading = line.match(/^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/);
    if (heading) {
      flush();
      const h = el("h" + Math.min(6, heading[1].length + 2));   // h3..h6: below the page's own headings
      inline(h, heading[2]);
      out.appendChild(h);
      continue;
    }
    if (/^\s{0,3}([-*_])(\s*\1){2,}\s*$/.test(line) && para.length === 0) { out.appendChild(el("hr")); continue; }
    if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      flush();
      const rows = [line, lines[i + 1]];
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(lines[i++]);
      i--;
      out.appendChild(table(rows));
      continue;
    }
    if (LIST_ITEM.test(line) && !(para.length && /^\s*\d/.test(line) && !/^\s*1[.)]/.test(line))) {
      flush();
      const items = [];
      while (i < lines.length && lines[i].trim() &&
             (LIST_ITEM.test(lines[i]) || (items.length && /^\s+\S/.test(lines[i])))) items.push(lines[i++]);
      i--;
      for (const node of list(items)) out.appendChild(node);
      continue;
    }
    const quote = line.match(/^\s{0,3}>\s?(.*)$/);
    if (quote) {
      flush();
      const inner = [quote[1]];
      while (i + 1 < lines.length && /^\s{0,3}>/.test(lines[i + 1])) inner.push(lines[++i].replace(/^\s{0,3}>\s?/, ""));
      const q = el("blockquote");
      q.appendChild(render(inner.join("\n")));
      out.appendChild(q);
      continue;
    }
    if (line.trim() === "") flush(); else para.push(line);
  }
  flush();
  return out;
}

// --- the conversation ---------------------------------------------------------------------------

function addMessage(role, content) {
  $("empty")?.remove();
  const box = el("div", "message " + role);
  const head = el("div", "head");
  head.appendChild(el("span", "role", role));
  head.appendChild(copyButton(() => box.dataset.text || ""));
  box.appendChild(head);
  box.dataset.text = content;
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

function showReasoning(box, text) {
  // the reply's reasoning so far, as text, in its collapsible block (made, open, on the first piece)
  let block = box.querySelector(".reasoning");
  if (!block) {
    block = el("details", "reasoning");
    block.open = true;
    block.appendChild(el("summary", "", "Reasoning"));
    block.appendChild(el("div", "reasoning-text"));
    box.insertBefore(block, box.querySelector(".content"));
  }
  block.querySelector(".reasoning-text").textContent = text;
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
    ...($("model").value ? {model: $("model").value} : {}),
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
  let reasoning = "";
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
          if (chunk.model && box.dataset.model !== chunk.model) {   // the model that answers, as the server says
            box.dataset.model = chunk.model;
            box.querySelector(".role").textContent = "assistant · " + chunk.model;
          }
          const delta = chunk.choices?.[0]?.delta;
          const thought = delta?.reasoning_content;
          if (thought) {
            reasoning += thought;
            showReasoning(box, reasoning);
          }
          const piece = delta?.content;
          if (piece) {
            const block = box.querySelector(".reasoning");
            if (!reply && block) block.open = false;   // the answer starts: the reasoning folds away
            reply += piece;
            box.dataset.chunks = String(Number(box.dataset.chunks) + 1);
            show(box, reply);
          }
        }
      }
    }
    box.dataset.state = "done";
    const secs = (performance.now() - started) / 1000;
    const thinking = usage?.completion_tokens_details?.reasoning_tokens;
    status(usage ? `${usage.completion_tokens} tokens${thinking ? ` (${thinking} reasoning)` : ""} in ${secs.toFixed(1)} s`
                 : "");
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
  loadModels();   // the picked model is loaded now: its label says so
  if (reply) conversation.push({role: "assistant", content: reply});
  else if (box.dataset.state !== "error") conversation.pop();   // nothing came back: the question can be asked again
}

async function loadModels() {
  // every model the server can answer with; the loaded ones first, the one picked before kept
  const picker = $("model");
  const response = await fetch("/v1/models", {headers: headers()});
  if (!response.ok) {
    const why = response.status === 401 ? "enter the API key in the settings" : await errorText(response);
    picker.replaceChildren(el("option", "", why));
    picker.options[0].value = "";
    status(why);
    return;
  }
  const models = (await response.json()).data;
  const ordered = models.filter((m) => m.loaded !== false).concat(models.filter((m) => m.loaded === false));
  const previous = picker.value;
  picker.replaceChildren(...ordered.map((m) => {
    const option = el("option", "", m.id + (m.loaded === false ? " (loads on first use)" : ""));
    option.value = m.id;
    return option;
  }));
  if (ordered.some((m) => m.id === previous)) picker.value = previous;
  picker.dataset.ready = "true";
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
  $("api-key").addEventListener("change", loadModels);
  $("settings-toggle").addEventListener("click", () => {
    const open = document.body.classList.toggle("show-settings");
    $("settings-toggle").setAttribute("aria-expanded", String(open));
  });
  loadModels();
});

window.barellmChat = {render, conversation};
