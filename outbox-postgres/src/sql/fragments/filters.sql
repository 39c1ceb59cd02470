-- filters (R19): the fetch's topic, aggregate type and aggregate id filters, each NULL for any
-- ({topics} text[], {aggregate_types} text[], {aggregate_ids} uuid[]).
({topics} IS NULL OR @.topic = ANY({topics}))
AND ({aggregate_types} IS NULL OR @.aggregate_type = ANY({aggregate_types}))
AND ({aggregate_ids} IS NULL OR @.aggregate_id = ANY({aggregate_ids}))
