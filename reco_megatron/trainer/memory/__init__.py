"""The example configs' memory budgets, and the estimate checked against megatron-core.

``python -m reco_megatron.trainer.memory.budget`` prints the budget tables;
``python -m reco_megatron.trainer.memory.check`` compares the estimate's static part with what
megatron-core allocates. The rest of the package imports the names below.
"""

from reco_megatron.trainer.memory.budget import (
    EXAMPLES,
    MOE_EXAMPLES,
    TOLERANCE,
    compare,
    example_budgets,
    table,
)

__all__ = ["EXAMPLES", "MOE_EXAMPLES", "TOLERANCE", "compare", "example_budgets", "table"]
