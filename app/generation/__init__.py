"""What both APIs do with the engine requests one body fans out into: the rules they obey
(`items.py`) and submitting them together (`submit.py`)."""

from .items import MAX_RID_LENGTH as MAX_RID_LENGTH
from .items import check_fan_out as check_fan_out
from .items import check_rid as check_rid
from .items import seeded_sample as seeded_sample
from .submit import submit_all as submit_all
