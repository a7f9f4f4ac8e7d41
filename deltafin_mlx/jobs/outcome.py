"""What a batch or score job did with its lines: the error line that answers a
line that cannot run, and the run's count of answers and errors, which gives its
last line and exit status."""

from dataclasses import dataclass
from typing import Optional

from deltafin_mlx.jobs.batch_lines import Request
from deltafin_mlx.jobs.results_file import STDOUT


def error_line(req: Request, message: str) -> dict:
    out = {"id": req.id, "line": req.line, "error": message}
    if req.custom_id:
        out["custom_id"] = req.id
    return out


# Exit statuses of batch and score jobs (README, "Exit statuses"): 0 every line
# answered; 1 the job could not run, or every line it tried failed; 3 it finished
# with some lines answered by error lines.
FAILED, PARTIAL = 1, 3


@dataclass
class Outcome:
    """What a run of a job did with its lines: how many it answered now and how
    many of those are error lines, for its last line and exit status."""

    label: str  # the job: "batch", "score" or "perplexity" (whose lines are windows)
    answered: int = 0  # error lines included
    errors: int = 0
    not_json: int = 0
    first_error: str = ""

    def add(self, result: dict):
        self.answered += 1
        if "error" in result:
            self.errors += 1
            self.not_json += ": not JSON (" in result["error"]
            self.first_error = self.first_error or result["error"]

    @property
    def status(self) -> int:
        if not self.errors:
            return 0
        return FAILED if self.errors == self.answered else PARTIAL

    def last_line(self, out_path, hint: str = "") -> Optional[str]:
        """The line that ends a run with errors (None without): why every line
        failed, or how many did."""
        out_path = "stdout" if out_path == STDOUT else out_path
        if self.status == FAILED:
            if self.not_json == self.errors:
                return (f"every line is not JSON: {self.label} takes JSONL, one object per "
                        f"line (see deltafin-run {self.label} --help){hint}")
            return (f"every line failed ({self.errors} error lines in {out_path}; the first: "
                    f"{self.first_error})")
        if self.status == PARTIAL:
            return (f"{self.errors} of {self.answered} lines failed (error lines in "
                    f"{out_path}); exit status {PARTIAL}")
        return None
