"""The one exception type for bad input data: it names where (file and line or row) and which field."""

from __future__ import annotations


class DataError(ValueError):
    """A malformed record or unreadable data source.

    location: where the problem is. "data/train.jsonl:12" (1-based line) for JSONL; "file.csv row 5",
        "file.parquet row 5", "file.json item 5", "hub:name[split] row 5" (1-based, header excluded) otherwise;
        a bare path for problems with a whole file.
    field: the offending field ("completion", "messages[2].role"), or None when the whole record is at fault.
    message: what is wrong, without the location.

    str() reads ``data/train.jsonl:12: field 'completion': expected a string, got int``.
    """

    def __init__(self, location: str, message: str, field: str | None = None) -> None:
        self.location = location
        self.message = message
        self.field = field
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.location}: field '{self.field}'" if self.field else self.location
        return f"{where}: {self.message}"

    def __reduce__(self) -> tuple:
        # The default pickling passes str(self) back as the only argument; Ray and multiprocessing
        # pickle exceptions raised in workers, so rebuild from the real fields.
        return (type(self), (self.location, self.message, self.field))
