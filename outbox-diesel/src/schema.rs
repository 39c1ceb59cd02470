//! The outbox table as a diesel `table!`, checked in.
//!
//! It describes the default table `outbox_events` exactly as the ancestor's DDL defines it
//! (R78), column for column and in the same order; the migrations create
//! it from the DDL shared with `outbox-postgres` (see [`crate::migrations`]). The repository
//! queries with `diesel::sql_query` because the table name is configurable, but it decodes rows
//! with the SQL types declared here (see `OutboxRow`), so a column whose type drifted from this
//! file fails to compile or fails the schema test (`tests/schema.rs`) instead of misreading data.
//! Applications that keep the default table name can use this module with diesel's typed DSL.

diesel::table! {
    /// The outbox table (Appendix A; default name `outbox_events`).
    outbox_events (id) {
        /// Event id.
        id -> Uuid,
        /// Event type.
        #[max_length = 100]
        event_type -> Varchar,
        /// JSON payload.
        payload -> Jsonb,
        /// String headers as a JSON object, or null.
        headers -> Nullable<Jsonb>,
        /// Trace id.
        #[max_length = 64]
        trace_id -> Nullable<Varchar>,
        /// Idempotency key (partial unique index).
        #[max_length = 128]
        idempotency_key -> Nullable<Varchar>,
        /// Correlation id.
        #[max_length = 64]
        correlation_id -> Nullable<Varchar>,
        /// Causation id.
        #[max_length = 64]
        causation_id -> Nullable<Varchar>,
        /// Payload schema version.
        #[max_length = 50]
        schema_version -> Nullable<Varchar>,
        /// `pending`, `completed` or `failed`.
        #[max_length = 20]
        status -> Varchar,
        /// Counted attempts.
        attempts_made -> Int4,
        /// Attempt budget.
        max_attempts -> Int4,
        /// Last failure text.
        #[max_length = 2000]
        last_error -> Nullable<Varchar>,
        /// When the row is due.
        scheduled_at -> Timestamptz,
        /// When it was acknowledged.
        completed_at -> Nullable<Timestamptz>,
        /// Lease start.
        locked_at -> Nullable<Timestamptz>,
        /// Lease holder.
        #[max_length = 255]
        locked_by -> Nullable<Varchar>,
        /// Insert time (database clock).
        created_at -> Timestamptz,
        /// Last update time.
        updated_at -> Nullable<Timestamptz>,
        /// Aggregate type.
        #[max_length = 50]
        aggregate_type -> Varchar,
        /// Aggregate id.
        aggregate_id -> Uuid,
        /// Topic.
        #[max_length = 255]
        topic -> Varchar,
        /// Partition key.
        #[max_length = 255]
        partition_key -> Varchar,
    }
}
