"""`deltafin-run MODEL --chat`: a conversation at the terminal, one turn a message,
the model's cache kept between turns (and in a session file with --session)."""

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
  /help     this help
  /reset    forget the conversation (and empty the model's cache)
  /stats    expert-cache counters so far
  /context  how much of the context is in use, and how far the budget lets it grow
  /drop [N] forget the oldest N exchanges (default 1); the rest is prefilled again
  /quit     leave (so do Ctrl-D, and Ctrl-C at an empty prompt)
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
            if command in ("/quit", "/exit"):
                break
            if command == "/help":
                print(HELP, file=sys.stderr)
            elif command == "/reset":
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
