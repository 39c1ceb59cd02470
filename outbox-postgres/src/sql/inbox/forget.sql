-- forget (R185, R127 in a batch): deletes the row this transaction landed for a run that is
-- rewound, by the primary key of both layouts.
-- Parameters: $1 uuid id, $2 timestamptz created_at.
DELETE FROM {table} WHERE id = $1::uuid AND created_at = $2::timestamptz
