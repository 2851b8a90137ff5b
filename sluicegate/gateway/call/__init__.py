"""One admitted request's life: the call, its stream, spans, settlement and the whole-answer builder."""
