"""What a run needs around the step: the pieces built from its settings
(`experiment`), the run directory, interrupts, distributed start-up and the
persistent compilation cache."""
