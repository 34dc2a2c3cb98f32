"""The audit runner: questions in, one durable record per question out."""
