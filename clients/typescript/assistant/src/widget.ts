// <toolmesh-assistant>: the conversation, each tool call as it happens, a stop button, and the
// confirmation as a modal dialog. Each code shows its fixed message (the turn table).
// Themable through CSS custom properties (README, "Theming"); `defineAssistantElement()`
// registers it.
import type { Assistant, AssistantState, ConfirmationRequest } from "./assistant.js";
import type { ToolProgressReport } from "./channel.js";
import { AgentError, messageOf } from "./errors.js";
import type { Message } from "./model.js";

const STYLE = `
:host { display: block; font: var(--tm-font, 14px/1.4 system-ui, sans-serif); color: var(--tm-fg, #1b1b1f);
  background: var(--tm-bg, #fff); border: 1px solid var(--tm-border, #767680); border-radius: var(--tm-radius, 8px);
  padding: var(--tm-gap, 12px); max-width: var(--tm-width, 36rem); }
h2 { font-size: 1.05em; margin: 0 0 .5em; }
[role=log] { max-height: var(--tm-log-height, 22rem); overflow-y: auto; }
ol { list-style: none; margin: 0; padding: 0; }
li { margin: .35em 0; padding: .4em .6em; border-radius: var(--tm-radius, 8px); white-space: pre-wrap; }
li.user { background: var(--tm-user-bg, #e3ecff); }
li.assistant { background: var(--tm-assistant-bg, #f1f1f4); }
li.tool { border-left: 4px solid var(--tm-accent, #2451b7); font-size: .92em; }
li.tool.failed { border-left-color: var(--tm-danger, #a4161a); }
.code { font-family: ui-monospace, monospace; font-weight: 600; }
[role=alert] { color: var(--tm-danger, #a4161a); margin: .5em 0; }
[role=status] { min-height: 1.4em; margin: .4em 0; color: var(--tm-muted, #45454f); }
progress { width: 100%; accent-color: var(--tm-accent, #2451b7); }
form { display: flex; gap: .5em; align-items: flex-end; flex-wrap: wrap; }
label { flex-basis: 100%; font-weight: 600; }
textarea { flex: 1; min-height: 2.6em; font: inherit; }
button { font: inherit; padding: .4em .9em; border-radius: var(--tm-radius, 8px); border: 1px solid var(--tm-accent, #2451b7);
  background: var(--tm-button-bg, #fff); color: var(--tm-accent, #2451b7); cursor: pointer; }
button.primary { background: var(--tm-accent, #2451b7); color: var(--tm-accent-fg, #fff); }
button:focus-visible, textarea:focus-visible { outline: 3px solid var(--tm-focus, #f2a900); outline-offset: 2px; }
dialog { border: 1px solid var(--tm-border, #767680); border-radius: var(--tm-radius, 8px); color: inherit;
  background: var(--tm-bg, #fff); max-width: 30rem; }
dialog::backdrop { background: var(--tm-backdrop, rgb(0 0 0 / .35)); }
pre { white-space: pre-wrap; background: var(--tm-assistant-bg, #f1f1f4); padding: .5em; max-height: 12rem; overflow: auto; }
.actions { display: flex; gap: .5em; justify-content: flex-end; }
`;

const TEMPLATE = `
<section aria-labelledby="title">
  <h2 id="title" part="title">Assistant</h2>
  <div part="log" role="log" aria-label="Conversation" aria-live="polite" tabindex="0"><ol></ol></div>
  <p part="status" role="status" aria-live="polite"></p>
  <progress part="progress" aria-label="Tool progress" hidden></progress>
  <p part="error" role="alert" hidden></p>
  <form part="composer">
    <label for="input">Message</label>
    <textarea id="input" part="input" rows="2"></textarea>
    <button type="submit" class="primary" part="send">Send</button>
    <button type="button" part="stop" id="stop" disabled>Stop</button>
  </form>
  <dialog part="dialog" aria-labelledby="dialog-title" aria-describedby="dialog-text">
    <h2 id="dialog-title"></h2>
    <p id="dialog-text"></p>
    <pre id="dialog-args" aria-label="Input"></pre>
    <div class="actions">
      <button type="button" id="deny">Cancel</button>
      <button type="button" id="allow" class="primary">Confirm</button>
    </div>
  </dialog>
</section>
`;

function codeLine(code: string): [HTMLElement, Text] {
  const span = document.createElement("span");
  span.className = "code";
  span.textContent = code;
  return [span, document.createTextNode(` ${messageOf(code as AgentError["code"])}`)];
}

/** A progress report in words: "(3 of 10: message)", or the value alone without a total. */
function progressText(report: ToolProgressReport): string {
  const amount = report.total === undefined ? `${report.progress}` : `${report.progress} of ${report.total}`;
  return report.message === "" ? `(${amount})` : `(${amount}: ${report.message})`;
}

/** The custom element; `assistant` attaches it, `confirm` is the Confirm to give the Assistant. */
export class ToolmeshAssistantElement extends HTMLElement {
  private readonly root: ShadowRoot;
  private current: Assistant | null = null;
  private unsubscribe: (() => void) | null = null;
  private notice = "";
  // The messages the conversation's items show, in order.
  private shown: Message[] = [];

  constructor() {
    super();
    this.root = this.attachShadow({ mode: "open" });
    this.root.innerHTML = `<style>${STYLE}</style>${TEMPLATE}`;
    this.find("form").addEventListener("submit", (event) => {
      event.preventDefault();
      void this.submit();
    });
    this.find("#input").addEventListener("keydown", (event) => {
      const key = event as KeyboardEvent;
      if (key.key === "Enter" && !key.shiftKey) {
        key.preventDefault();
        void this.submit();
      }
    });
    this.find("#stop").addEventListener("click", () => this.current?.cancel());
  }

  private find<T extends HTMLElement = HTMLElement>(selector: string): T {
    return this.root.querySelector(selector) as T;
  }

  /** The assistant the element shows and sends to. */
  get assistant(): Assistant | null {
    return this.current;
  }

  set assistant(assistant: Assistant | null) {
    this.unsubscribe?.();
    this.current = assistant;
    this.unsubscribe = assistant?.subscribe((state) => this.render(state)) ?? null;
    if (assistant !== null) this.render(assistant.state);
  }

  /** Send the text in the input (what the Send button does). */
  async submit(): Promise<void> {
    const input = this.find<HTMLTextAreaElement>("#input");
    const text = input.value.trim();
    if (text === "" || this.current === null) return;
    try {
      const pending = this.current.send(text);
      input.value = "";
      await pending;
    } catch (error) {
      if (error instanceof AgentError && error.code === "BUSY") {
        // BUSY changes nothing in the state: the element says so on its own.
        this.notice = "BUSY";
        this.render(this.current.state);
      }
    }
  }

  /** Ask the person in a modal dialog: Confirm runs the tool; Cancel or Escape refuse it. */
  readonly confirm = (request: ConfirmationRequest): Promise<boolean> => {
    const dialog = this.find<HTMLDialogElement>("dialog");
    const allow = this.find<HTMLButtonElement>("#allow");
    const deny = this.find<HTMLButtonElement>("#deny");
    this.find("#dialog-title").textContent = `Run ${request.tool.name}?`;
    this.find("#dialog-text").textContent = request.tool.description || "The assistant wants to run this tool.";
    this.find("#dialog-args").textContent = JSON.stringify(request.arguments, null, 2);
    const deep = (root: Document | ShadowRoot): Element | null => {
      const active = root.activeElement;
      return active?.shadowRoot ? (deep(active.shadowRoot) ?? active) : active;
    };
    const before = deep(document) as HTMLElement | null;
    return new Promise<boolean>((resolve) => {
      const finish = (answer: boolean): void => {
        allow.removeEventListener("click", yes);
        deny.removeEventListener("click", no);
        dialog.removeEventListener("cancel", escape);
        request.signal.removeEventListener("abort", withdrawn);
        if (dialog.open) dialog.close();
        before?.focus?.();
        resolve(answer);
      };
      const yes = (): void => finish(true);
      const no = (): void => finish(false);
      const escape = (event: Event): void => {
        event.preventDefault();
        finish(false);
      };
      const withdrawn = (): void => finish(false);
      allow.addEventListener("click", yes);
      deny.addEventListener("click", no);
      dialog.addEventListener("cancel", escape);
      request.signal.addEventListener("abort", withdrawn, { once: true });
      dialog.showModal();
      deny.focus();
    });
  };

  private render(state: AssistantState): void {
    this.renderMessages(state.messages);
    const running = state.status === "running";
    this.find<HTMLButtonElement>("#stop").disabled = !running;
    const status = this.find("[role=status]");
    const activity = state.activity;
    const report = running && activity?.kind === "calling" ? activity.progress : undefined;
    status.textContent = !running
      ? state.status === "disposed"
        ? "The assistant is closed."
        : ""
      : activity?.kind === "calling"
        ? `Running ${activity.tool.name}…${report === undefined ? "" : ` ${progressText(report)}`}`
        : activity?.kind === "confirming"
          ? `Waiting for your confirmation of ${activity.tool.name}…`
          : "Thinking…";
    const bar = this.find<HTMLProgressElement>("progress");
    bar.hidden = report === undefined;
    if (report?.total !== undefined) {
      bar.max = report.total;
      bar.value = Math.min(report.progress, report.total);
    } else {
      bar.removeAttribute("value"); // indeterminate: the handler gave no total
    }
    const alert = this.find("[role=alert]");
    const code = state.error?.code ?? (this.notice !== "" && running ? this.notice : "");
    if (!running) this.notice = "";
    alert.hidden = code === "";
    alert.dataset["code"] = code;
    alert.replaceChildren(...(code === "" ? [] : codeLine(code)));
  }

  /**
   * The conversation's items, one per message, changed only where the messages did: messages are
   * appended, and the assistant drops old turns from the front (maxMessages), so the DOM changes
   * by those items alone and a long conversation costs nothing per state change.
   */
  private renderMessages(messages: readonly Message[]): void {
    const log = this.find("ol");
    const current = new Set(messages);
    let dropped = 0;
    while (dropped < this.shown.length && !current.has(this.shown[dropped]!)) dropped += 1;
    const kept = this.shown.slice(dropped);
    if (kept.some((message, index) => messages[index] !== message)) {
      // Not a trim and an append (clear(), a new assistant): draw it all again.
      this.shown = [];
      log.replaceChildren();
    } else {
      for (let index = 0; index < dropped; index += 1) log.firstElementChild?.remove();
      this.shown = kept;
    }
    if (this.shown.length === messages.length) return;
    const added = messages.slice(this.shown.length);
    log.append(...added.map((message) => this.item(message)));
    this.shown = [...this.shown, ...added];
    const scroller = this.find("[role=log]");
    scroller.scrollTop = scroller.scrollHeight;
  }

  private item(message: Message): HTMLLIElement {
    const item = document.createElement("li");
    item.className = message.role;
    if (message.role === "user") {
      item.textContent = message.text;
    } else if (message.role === "assistant") {
      item.textContent =
        message.text || `Calling ${message.toolCalls.map((c) => c.name).join(", ")}…`;
    } else {
      item.dataset["tool"] = message.call.name;
      if (message.result.ok) {
        item.textContent = `${message.call.name} ✓ ${message.result.text.slice(0, 200)}`;
      } else {
        item.classList.add("failed");
        item.dataset["code"] = message.result.code ?? "";
        item.append(`${message.call.name}: `, ...codeLine(message.result.code ?? "INTERNAL"));
      }
    }
    return item;
  }
}

/** Register the element under `tag` (once); returns its class. */
export function defineAssistantElement(tag = "toolmesh-assistant"): typeof ToolmeshAssistantElement {
  if (customElements.get(tag) === undefined) {
    customElements.define(tag, class extends ToolmeshAssistantElement {});
  }
  return customElements.get(tag) as unknown as typeof ToolmeshAssistantElement;
}
