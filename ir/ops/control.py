"""Control flow and sequence/optional ops: carried through, lowered only where a backend can."""

from ir.ops.registry import CONTROL, register

register("If", "Loop", "Scan", "SequenceConstruct", "SequenceEmpty", "SequenceAt", "SequenceInsert",
         "SequenceErase", "SequenceLength", "SplitToSequence", "ConcatFromSequence", "SequenceMap",
         "Optional", "OptionalGetElement", "OptionalHasElement", kind=CONTROL)
