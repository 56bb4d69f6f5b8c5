"""Model building blocks shared by every architecture (TP-aware where it matters)."""
