//! Reliability under faults, load and churn (Soft-RoCE VM; see docs/reliability.md).
