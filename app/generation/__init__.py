"""What every API does with the engine requests one body fans out into: the rules they obey
(`items.py`), submitting them together (`submit.py`) and folding their output
(`generated.py`)."""

from .generated import Generated as Generated
from .generated import collect_into as collect_into
from .items import MAX_RID_LENGTH as MAX_RID_LENGTH
from .items import check_fan_out as check_fan_out
from .items import check_rid as check_rid
from .items import seeded_sample as seeded_sample
from .submit import submit_all as submit_all
from .submit import submit_owned as submit_owned
