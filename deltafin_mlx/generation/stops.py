"""Stop strings: where generated text ends, found as the text streams.

The one rule, for a run, a chat, a batch and `generate`: the text ends just before
the earliest occurrence of any of the stop strings (empty ones mean nothing). Text
arrives in segments (a token's worth, or less); a stop may span several of them.
`StopMatcher` passes each segment on as soon as no stop can start in it, holding
back only a tail that is the beginning of some stop string, and searches only that
tail and the new segment, so a long reply costs the same per token as a short one.
"""

from typing import Iterable, List


class StopMatcher:
    """Streams text and finds the first stop string in it.

    add(segment) returns the text that can be shown now; once `stopped`, the text
    from the stop on is dropped and every later segment is ignored. flush() returns
    what was held back when the stream ends without a stop. `text` is everything
    passed on so far plus what is held back: after a stop, the text up to it.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops: List[str] = [s for s in stops if s]
        self.stopped = False
        self._passed: List[str] = []
        self._held = ""  # the tail that could be the start of a stop string

    @property
    def text(self) -> str:
        return "".join(self._passed) + self._held

    def add(self, segment: str) -> str:
        """The part of `segment` (and of the held-back tail) that no stop can reach."""
        if self.stopped or not segment:
            return ""
        # A stop that starts before the held tail would have ended inside text
        # already searched: only the tail and the new segment can hold one.
        return self._emit(self._held + segment, final=False)

    def flush(self) -> str:
        """The held-back tail, at the end of the stream: cut at a stop it holds."""
        if self.stopped:
            return ""
        return self._emit(self._held, final=True)

    def _emit(self, window: str, final: bool) -> str:
        cut = self._earliest(window)
        if cut is not None:
            # A longer stop starting before this one may still be completing
            # ("aba" begun at 0 when "b" is found at 1): wait for it unless the
            # stream has ended.
            start = None if final else self._open_start(window, cut)
            if start is None:
                self.stopped = True
                out, self._held = window[:cut], ""
            else:
                out, self._held = window[:start], window[start:]
        elif final:
            out, self._held = window, ""
        else:
            hold = self._open_prefix(window)
            out, self._held = window[: len(window) - hold], window[len(window) - hold:]
        self._passed.append(out)
        return out

    def _earliest(self, window: str):
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _open_start(self, window: str, before: int):
        """The first position before `before` from which the rest of `window` is a
        proper beginning of some stop string, or None."""
        longest = max(len(x) for x in self.stops)
        for j in range(max(0, len(window) - longest + 1), before):
            rest = window[j:]
            if any(len(rest) < len(x) and x.startswith(rest) for x in self.stops):
                return j
        return None

    def _open_prefix(self, window: str) -> int:
        """The length of the longest end of `window` that begins some stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(window)), longest, -1):
                if window.endswith(s[:n]):
                    longest = n
                    break
        return longest
