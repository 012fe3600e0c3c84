"""What every built-in job type's payload model shares: a field it does not know is refused at
submit, with its name (a typo must not be silently ignored, leaving a default in its place)."""

from pydantic import BaseModel, ConfigDict


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid")
