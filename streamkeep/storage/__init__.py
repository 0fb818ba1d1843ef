"""Where stream bytes and metadata live. `base` defines the interface; `memory` implements it."""
