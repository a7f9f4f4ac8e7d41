"""`deltafin-run MODEL --chat`: a conversation at the terminal, one turn a message,
the model's cache kept between turns (and in a session file with --session)."""

import contextlib
import re
import signal
import sys
from dataclasses import replace

import mlx.core as mx

from deltafin_mlx.chat.session import ChatSession, session_path
from deltafin_mlx.chat.context import status as context_status
from deltafin_mlx.cli.options import (check_request_flags, defaults_of, load_model,
                                      refuse_without_template)
from deltafin_mlx.cli.reply import ReplyPrinter
from deltafin_mlx.errors import ContextError, SessionSaveError
from deltafin_mlx.generation.stream import PrefillProgress
from deltafin_mlx.engine.runtime import runtime


def cmd_chat(args, model_dir=None) -> int:
    from deltafin_mlx.engine.load import open_tokenizer
    from deltafin_mlx.format.model_dir import open_model_dir

    model_dir = model_dir or open_model_dir(args.model)
    tokenizer = open_tokenizer(model_dir)
    refuse_without_template(tokenizer, args)
    model, _ = load_model(args, model_dir, tokenizer=tokenizer)
    current = [model]  # the model as last (re)loaded: the one to close

    def reload(context):
        """The model planned again for `context` tokens in the same budget."""
        args.budget = runtime(current[0]).plan.budget
        runtime(current[0]).close()  # its hot set is saved and read back by the new one
        current[0], _ = load_model(args, model_dir, tokenizer=False, context=context)
        return current[0]

    try:
        return run_chat(model, tokenizer, args, reload)
    finally:
        runtime(current[0]).close()


HELP = """\
Type a message and press Enter. End a line with \\ to continue it on the next line,
or put \"\"\" on a line of its own to start and end a block of several lines; a paste
of several lines is one message.
  /help     this help (or /?)
  /reset    forget the conversation (and empty the model's cache) (or /clear)
  /stats    expert-cache counters so far
  /context  how much of the context is in use, and how far the budget lets it grow
  /drop [N] forget the oldest N exchanges (default 1); the rest is prefilled again
  /set parameter NAME VALUE   a sampling parameter, by ollama's name (temperature,
            top_p, top_k, min_p, seed, num_predict, repeat_penalty, repeat_last_n,
            presence_penalty, frequency_penalty, stop) or the option's (temp, ...)
  /set system TEXT   a new system message (the conversation is prefilled again)
  /set think, /set nothink   thinking on or off from the next turn
  /show info|parameters|system|template   the model, the parameters, the system
            message, the chat template
  /save NAME  save the conversation, its cache and parameters to NAME.safetensors
  /load NAME  continue the conversation saved as NAME (by /save or --session)
  /quit     leave (so do /bye, Ctrl-D, and Ctrl-C at an empty prompt)
A line starting with // is sent as a message that starts with /.
Ctrl-C while a reply is generated stops it; the reply so far is KEPT in the history
(the model sees it, closed as a finished turn, in the next turn). Ctrl-C before the
reply begins (while a long message is prefilled) DROPS the turn: the conversation,
the model's cache and the session file stay exactly as they were.
The context grows with the conversation: re-planned in steps up to what the budget
holds (the expert cache shrinks to make room), one line saying so; beyond that,
/drop makes room. With --session FILE the conversation and the model's cache are saved after every
turn and restored at the next start, so the history is not prefilled again."""


DROPPED = ("interrupted before the reply began: the turn is dropped; the conversation, "
           "the cache and the session file are as before it")


class StopOnSignal:
    """While active, Ctrl-C asks the current turn to stop at the next token (or
    prefill chunk) instead of raising; a second Ctrl-C raises as usual."""

    def __init__(self):
        self.requested = False
        self.previous = None

    def __enter__(self):
        self.requested = False

        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        self.previous = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        return False

    def __call__(self) -> bool:
        return self.requested


PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"  # a terminal's bracketed paste


class Pasted(str):
    """A message holding a paste: text, never a command (even after an end marker)."""


def bracketed_paste(tty: bool):
    """Have a paste of several lines arrive as one message, as text: the terminal
    is asked for its markers (ESC[200~ ... ESC[201~), read_message joins the lines
    between them (True: the mode was set, to be reset at the end). GNU readline
    inserts the markers as they are (quoted-insert): its own paste mode would end a
    paste at a marker the paste holds and take what follows as typed. libedit: as is."""
    if not tty:
        return False
    try:
        import readline

        if "libedit" in (readline.__doc__ or ""):
            return False
        readline.parse_and_bind("set enable-bracketed-paste off")
        for marker in ("200~", "201~"):
            readline.parse_and_bind(f'"\\e[{marker}": "\\C-v\\e[{marker}"')
    except ImportError:
        pass
    sys.stdout.write("\x1b[?2004h")
    sys.stdout.flush()
    return True


def read_message(prompt: str = "> ", more: str = "... ", out=None):
    """One message from the user: None at end of input (Ctrl-D, or Ctrl-C at an
    empty prompt); "" when a Ctrl-C cleared a half-typed line. A bracketed paste
    (ESC[200~ ... ESC[201~, whatever lines it spans) is part of one message."""
    out = out or sys.stderr
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

    def line(p):
        if tty:
            return input(p)
        print(p, end="", file=out, flush=True)
        s = sys.stdin.readline()
        if not s:
            raise EOFError
        return s.rstrip("\n")

    try:
        first = line(prompt)
        if PASTE_START in first or PASTE_END in first:  # an end alone: a paste's rest
            while first.count(PASTE_START) > first.count(PASTE_END):
                first += "\n" + line("")
            return Pasted(first.replace(PASTE_START, "").replace(PASTE_END, ""))
        if first.strip() == '"""':
            lines = []
            while True:
                s = line(more)
                if s.strip() == '"""':
                    return "\n".join(lines)
                lines.append(s)
        lines = [first]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(line(more))
        return "\n".join(lines)
    except EOFError:
        return None
    except KeyboardInterrupt:
        try:
            import readline

            typed = readline.get_line_buffer()
        except ImportError:
            typed = ""
        print(file=out)
        return "" if typed else None


# `/set parameter` (ollama's names) -> (the option's attribute, the request field
# whose rule checks it, its type); the option's own name works too (temp, max_tokens).
PARAMETERS = {"temperature": ("temp", "temperature", float),
              "top_p": ("top_p", "top_p", float), "top_k": ("top_k", "top_k", int),
              "min_p": ("min_p", "min_p", float), "seed": ("seed", "seed", int),
              "num_predict": ("max_tokens", "max_tokens", int),
              "repeat_penalty": ("repetition_penalty", "repetition_penalty", float),
              "repeat_last_n": ("penalty_context", "repetition_context_size", int),
              "presence_penalty": ("presence_penalty", "presence_penalty", float),
              "frequency_penalty": ("frequency_penalty", "frequency_penalty", float),
              "stop": ("stop", "stop", str)}


def set_parameter(args, session, name: str, values) -> str:
    """Set one sampling parameter as ollama's `/set parameter NAME VALUE` does,
    checked by the rule the option's flag gets; ollama's line, or a UsageError."""
    import argparse

    from deltafin_mlx.cli.options import request_field
    from deltafin_mlx.errors import UsageError

    key = name if name in PARAMETERS else next(
        (k for k, (attr, _, _) in PARAMETERS.items() if attr == name), None)
    if key is None or not values:
        raise UsageError(f"unknown parameter {name!r}: one of {', '.join(PARAMETERS)}"
                         if key is None else "/set parameter NAME VALUE")
    attr, field, parse = PARAMETERS[key]
    before = getattr(args, attr)
    try:
        check = request_field(field, parse)
        setattr(args, attr, [check(v) for v in values] if key == "stop" else check(values[0]))
        check_request_flags(args, session.model)
    except (argparse.ArgumentTypeError, UsageError) as e:
        setattr(args, attr, before)
        raise UsageError(str(e)) from None
    if key == "seed":
        mx.random.seed(args.seed)
    session.parameters[key] = getattr(args, attr)
    return f"Set parameter '{name}' to '{', '.join(values)}'"


def show(what: str, session, args) -> str:
    """ollama's `/show info|parameters|system|template`."""
    from deltafin_mlx.model.quantization import quantization_by_part, quantization_summary

    if what == "info":
        state = runtime(session.model)
        m, ex = state.manifest, state.manifest.experts
        quant = quantization_summary(quantization_by_part(state.model_dir.config, m))
        return (f"  architecture   {m.model_type}, {m.num_layers} layers, {len(m.moe_layers)} "
                f"of them MoE\n  experts        {ex['num_experts']} per MoE layer, "
                f"{ex['experts_per_token']} per token\n  quantization   {quant}\n"
                f"  plan           {state.plan.context:,} tokens of context in a budget of "
                f"{state.plan.budget / 1e9:.2f} GB")
    if what == "parameters":
        return "Parameters:\n" + "\n".join(
            f"  {key:<30} {getattr(args, attr)}" for key, (attr, _, _) in PARAMETERS.items()
            if getattr(args, attr) not in (None, []))
    if what == "system":
        return session.system or "No system message was specified for this model."
    if what == "template":
        template = getattr(session.tokenizer, "chat_template", None)
        return template if isinstance(template, str) and template else \
            "No prompt template was specified for this model."
    return f"Unknown command '/show {what}'. Type /? for help"


def ollama_command(command: str, session, args, reload):
    """/set, /show, /save and /load as ollama has them; (the session from now on,
    the line to print)."""
    from deltafin_mlx.errors import SessionError, UsageError

    verb, *rest = command.split()
    if verb == "/show":
        return session, show(rest[0] if rest else "", session, args) if rest else \
            "Usage: /show info|parameters|system|template"
    if verb in ("/save", "/load") and len(rest) != 1:
        return session, f"Usage:\n  {verb} <name>"
    if verb == "/save":
        try:
            session.save(rest[0])
        except SessionSaveError as e:
            return session, str(e)
        return session, f"Saved the conversation as '{session_path(rest[0])}'"
    if verb == "/load":
        try:
            loaded = ChatSession.restore(rest[0], session.model, session.tokenizer, reload=reload)
        except (SessionError, OSError) as e:
            return session, f"Couldn't load '{rest[0]}': {e}"
        for key, value in dict(loaded.parameters).items():  # checked as if typed
            with contextlib.suppress(UsageError):
                set_parameter(args, loaded, key, list(map(str, value if isinstance(
                    value, list) else [value])))
        return loaded, f"Loading session '{rest[0]}' ({len(loaded.messages)} messages)"
    if rest[:1] == ["system"]:
        if len(rest) == 1:
            return session, "Usage: /set system TEXT"
        session.set_system(command.split(None, 2)[2])
        return session, "Set system message."
    if rest[:1] in (["think"], ["nothink"]):
        session.thinking, session.cut = rest[0] == "think", True
        return session, f"Set '{rest[0]}' mode."
    name, values = (rest[1], rest[2:]) if rest[:1] == ["parameter"] and len(rest) > 1 else \
        (rest[0], rest[1:]) if rest else ("", [])
    if not name:
        return session, "Usage: /set parameter NAME VALUE, /set system TEXT, /set think|nothink"
    try:
        return session, set_parameter(args, session, name, values)
    except UsageError as e:
        return session, f"Couldn't set parameter: {e}"


def say_growth(session):
    """The one line saying the context grew (once per re-plan)."""
    if session.growth is not None:
        print(f"[{session.growth.line()}]", file=sys.stderr)
        session.growth = None


def save_session(session, path):
    """Save after a change (with --session); a save that fails (a full disk) is one
    line and the chat goes on: the file keeps the last state that was saved."""
    if path is None:
        return
    try:
        session.save(path)
    except SessionSaveError as e:
        print(f"[{e}]", file=sys.stderr)


def run_chat(model, tokenizer, args, reload=None) -> int:
    """The interactive loop; `args` as `deltafin-run` parses them; `reload(context)`
    loads the model for a larger context (ChatSession's)."""
    options = dict(system=args.system, thinking=not args.no_think,
                   thinking_effort=args.thinking_effort)
    path = session_path(args.session) if args.session else None
    if path is not None and path.exists():
        session = ChatSession.restore(path, model, tokenizer, reload=reload, **options)
        say_growth(session)
        used, pending = session.conversation_tokens()
        how = f"{used} tokens, prefilled again at the next turn" if pending else \
            f"{used} tokens, no prefill needed"
        print(f"[session] restored {sum(m['role'] != 'system' for m in session.messages)} "
              f"messages ({how}) from {path}", file=sys.stderr)
    else:
        session = ChatSession(model, tokenizer, reload=reload, **options)
    check_request_flags(args, model)
    if args.seed is not None:  # once: the turns draw one stream of samples
        mx.random.seed(args.seed)
    defaults = replace(defaults_of(args), seed=None)
    tty = sys.stdout.isatty()
    marked_pastes = bracketed_paste(sys.stdin.isatty())
    print("Deltafin chat: /help for help, /reset clears the history, /quit (or Ctrl-D) ends.",
          file=sys.stderr)
    while True:
        text = read_message()
        if text is None:
            break
        if not text.strip():
            continue
        command = "" if isinstance(text, Pasted) else text.strip()
        if command.startswith("/") and not command.startswith("//"):
            if command in ("/quit", "/exit", "/bye"):
                break
            if command in ("/help", "/?"):
                print(HELP, file=sys.stderr)
            elif command.split()[0] in ("/set", "/show", "/save", "/load"):
                session, said = ollama_command(command, session, args, reload)
                defaults = replace(defaults_of(args), seed=None)
                print(said if command.startswith("/show") else f"[{said}]", file=sys.stderr)
            elif command in ("/reset", "/clear"):
                session.reset()
                save_session(session, path)
                print("[history cleared]", file=sys.stderr)
            elif command == "/stats":
                s = runtime(session.model).stats
                print(f"[deltafin] {len(session.tokens)} tokens in the conversation; experts: "
                      f"{s.hits} hits, {s.misses} misses ({s.hit_rate:.0%} hit rate), "
                      f"{runtime(session.model).store.bytes_read / 1e6:.1f} MB read",
                      file=sys.stderr)
            elif command == "/context":
                print(f"[{context_status(session.model, *session.conversation_tokens()).line()}]",
                      file=sys.stderr)
            elif command.split()[0] == "/drop":
                turns = command.split()[1:] or ["1"]
                # ASCII digits only ("²" is a digit to str.isdigit, not to int), and
                # few enough for int() (a 5,000-digit number is refused by it).
                if len(turns) != 1 or not re.fullmatch(r"0*[1-9][0-9]{0,8}", turns[0]):
                    print("[/drop N: N is how many of the oldest exchanges to forget, 1 or more]",
                          file=sys.stderr)
                    continue
                dropped = session.drop_oldest(int(turns[0]))
                save_session(session, path)
                print(f"[dropped the oldest {dropped} messages; the next turn prefills the "
                      f"rest of the conversation ({session.conversation_tokens()[1]:,} tokens) "
                      "again]", file=sys.stderr)
                say_growth(session)
            else:
                print(f"[unknown command {command.split()[0]}: not sent; /help lists the "
                      "commands, // sends a message starting with /]", file=sys.stderr)
            continue
        if command.startswith("//"):
            text = text.lstrip()[1:]

        printer = ReplyPrinter(tty)

        progress = PrefillProgress(sys.stderr) if sys.stderr.isatty() else None
        try:
            try:
                with StopOnSignal() as stopper:
                    turn = session.ask(text, args.max_tokens, defaults=defaults,
                                       progress=progress, stop_requested=stopper,
                                       on_text=printer)
            finally:
                if progress is not None:
                    progress.clear()  # a prefill stopped midway leaves its line
        except ContextError:
            say_growth(session)
            st = context_status(session.model, len(session.tokens))
            print(f"[this turn does not fit: the budget holds at most {st.largest:,} tokens of "
                  f"context and the conversation has {st.used:,}; /drop N forgets the oldest N "
                  "exchanges, /reset starts over]", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print(f"\n[{DROPPED}]", file=sys.stderr)
            continue
        if turn.dropped:
            say_growth(session)
            print(f"[interrupted before the reply began, after prefilling {turn.prefilled:,} "
                  f"of {turn.prompt_tokens:,} tokens in {turn.stats.seconds:.1f} s: the turn "
                  f"is dropped; the conversation, the cache and the session file are as "
                  f"before it]", file=sys.stderr)
            continue  # nothing changed: the session file stays as it is
        printer.finish()
        say_growth(session)
        if turn.finish_reason == "interrupted":
            print(f"[interrupted: the reply so far ({len(turn.tokens)} tokens) is kept in the "
                  "history as a finished turn]", file=sys.stderr)
        print(f"[deltafin] {turn.stats.line()}; prefilled {turn.prefilled} tokens "
              f"({turn.reused} from the cache)", file=sys.stderr)
        save_session(session, path)
    if marked_pastes:
        sys.stdout.write("\x1b[?2004l")
    print(file=sys.stderr)
    return 0
