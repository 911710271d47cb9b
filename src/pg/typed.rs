//! [`Query`]: a statement, prepared once per pooled connection (the default), or else sent
//! unnamed with its parameter types, so that nothing it leaves on the server outlives the
//! transaction it runs in (`PgStoreBuilder::prepare_statements(false)`).
//!
//! A transaction-pooling proxy (PgBouncer's `pool_mode = transaction`) hands each transaction,
//! and each statement outside one, to whichever server connection is free. A named prepared
//! statement made on one server connection is then missing on the next (SQLSTATE 26000), and
//! one left behind clashes with another client's of the same name (42P05). So every statement
//! goes out as one unnamed Parse, Bind, Describe, Execute and Sync, in one round trip
//! (`query_typed`), which any pooler mode forwards as a unit. Without a prepare, the
//! parameter types must be sent along: they are read from the casts in the statement's text
//! (`$1::bigint`), which every parameter carries. The price: the server parses and plans the
//! statement every time, which costs the server more CPU per pair than executing it
//! (BENCHMARKS.md, "PgStore through PgBouncer"); so preparing stays the default.

use ::postgres::types::{ToSql, Type};
use ::postgres::{Client, GenericClient, Row, Statement};

/// A statement's text, the types of its parameters (`types[0]` is `$1`'s), and on a pooled
/// connection that prepares its statements, the prepared statement.
#[derive(Debug, Clone)]
pub(crate) struct Query {
    text: String,
    types: Vec<Type>,
    prepared: Option<Statement>,
    /// `text` calls the statement's routine, which answers one row, ending in whether the
    /// statement answered one (see `routines`).
    routed: bool,
}

impl Query {
    /// A statement whose every parameter `$n` is cast (`$n::bigint`) somewhere in `text`. A
    /// parameter without a known cast gets `Type::UNKNOWN`, which no value encodes to: the call
    /// then fails with the client's type error before anything is sent.
    pub(crate) fn new(text: String) -> Query {
        let types = parameter_types(&text);
        Query {
            text,
            types,
            prepared: None,
            routed: false,
        }
    }

    /// Prepares the statement on `client` (a named statement, which lives as long as the
    /// connection), so that later calls only bind and execute it.
    pub(crate) fn prepare(&mut self, client: &mut Client) -> Result<(), ::postgres::Error> {
        self.prepared = Some(client.prepare_typed(&self.text, &self.types)?);
        Ok(())
    }

    /// The statement's text.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// The types of its parameters, `$1`'s first.
    pub(crate) fn types(&self) -> &[Type] {
        &self.types
    }

    /// Sends `call` in place of the statement from now on: a call of the statement's routine,
    /// with the same parameters (see `routines`).
    pub(crate) fn route(&mut self, call: String) {
        self.text = call;
        self.routed = true;
    }

    fn typed<'a>(&self, params: &[&'a (dyn ToSql + Sync)]) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
        params
            .iter()
            .enumerate()
            .map(|(i, &p)| (p, self.types.get(i).cloned().unwrap_or(Type::UNKNOWN)))
            .collect()
    }

    /// Every row.
    pub(crate) fn query(
        &self,
        client: &mut impl GenericClient,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, ::postgres::Error> {
        let rows = match &self.prepared {
            Some(statement) => client.query(statement, params)?,
            None => client.query_typed(&self.text, &self.typed(params))?,
        };
        if !self.routed {
            return Ok(rows);
        }
        let mut answered = Vec::with_capacity(rows.len());
        for row in rows {
            if answered_by(&row)? {
                answered.push(row);
            }
        }
        Ok(answered)
    }

    /// Exactly one row. (A routine always answers one; the statements routed this way answer
    /// one too: see `Sql::routable_mut`.)
    pub(crate) fn query_one(
        &self,
        client: &mut impl GenericClient,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, ::postgres::Error> {
        match &self.prepared {
            Some(statement) => client.query_one(statement, params),
            None => client.query_typed_one(&self.text, &self.typed(params)),
        }
    }

    /// At most one row.
    pub(crate) fn query_opt(
        &self,
        client: &mut impl GenericClient,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, ::postgres::Error> {
        let row = match &self.prepared {
            Some(statement) => client.query_opt(statement, params)?,
            None => client.query_typed_opt(&self.text, &self.typed(params))?,
        };
        match row {
            Some(row) if self.routed && !answered_by(&row)? => Ok(None),
            row => Ok(row),
        }
    }

    /// The number of rows the statement wrote.
    pub(crate) fn execute(
        &self,
        client: &mut impl GenericClient,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, ::postgres::Error> {
        if self.routed {
            // A `CALL` reports no row count: the routine's answer says.
            return Ok(self.query(client, params)?.len() as u64);
        }
        match &self.prepared {
            Some(statement) => client.execute(statement, params),
            None => client.execute_typed(&self.text, &self.typed(params)),
        }
    }
}

/// Whether the statement behind a routine's row answered it (the row's last column).
fn answered_by(row: &Row) -> Result<bool, ::postgres::Error> {
    let last = row.len().saturating_sub(1);
    Ok(row.try_get::<_, Option<bool>>(last)?.unwrap_or(false))
}

/// The type of each `$n`, from the first `$n::type` cast in `text`.
fn parameter_types(text: &str) -> Vec<Type> {
    let mut types: Vec<Type> = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let Ok(n) = rest[..digits].parse::<usize>() else {
            continue;
        };
        let Some(cast) = rest[digits..].strip_prefix("::") else {
            continue;
        };
        let name_len = cast
            .bytes()
            .take_while(|b| b.is_ascii_lowercase() || *b == b'_')
            .count();
        let Some(mut ty) = builtin(&cast[..name_len]) else {
            continue;
        };
        if cast[name_len..].starts_with("[]") {
            // The distributed sweep's key lists (`$2::text[]`).
            let Some(array) = array_of(&ty) else {
                continue;
            };
            ty = array;
        }
        if types.len() < n {
            types.resize(n, Type::UNKNOWN);
        }
        if let Some(slot) = types.get_mut(n - 1).filter(|t| **t == Type::UNKNOWN) {
            *slot = ty;
        }
    }
    types
}

/// The array of a type the statements cast a parameter to as an array.
fn array_of(ty: &Type) -> Option<Type> {
    (*ty == Type::TEXT).then_some(Type::TEXT_ARRAY)
}

/// The types the statements cast their parameters to.
fn builtin(name: &str) -> Option<Type> {
    Some(match name {
        "bigint" => Type::INT8,
        "integer" => Type::INT4,
        "smallint" => Type::INT2,
        "text" => Type::TEXT,
        "bytea" => Type::BYTEA,
        "boolean" => Type::BOOL,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pg::sql::Sql;

    #[test]
    fn types_come_from_the_first_cast_of_each_parameter() {
        let query = Query::new(
            "SELECT $2::text, $1::bigint, $2::text, $3::bytea, '$4', $5::smallint".to_owned(),
        );
        assert_eq!(
            query.types,
            [
                Type::INT8,
                Type::TEXT,
                Type::BYTEA,
                Type::UNKNOWN,
                Type::INT2
            ]
        );
        assert!(Query::new("SELECT 1".to_owned()).types.is_empty());
    }

    #[test]
    fn an_array_cast_types_its_parameter_as_an_array() {
        let query = Query::new("SELECT $1::bigint, $2::text[], $3::text".to_owned());
        assert_eq!(query.types, [Type::INT8, Type::TEXT_ARRAY, Type::TEXT]);
    }

    #[test]
    fn every_parameter_of_every_statement_is_typed() {
        let single = Sql::new("s", true, false);
        let distributed = Sql::new("s", false, true);
        for query in single.all().into_iter().chain(distributed.all()) {
            assert!(
                !query.types.contains(&Type::UNKNOWN),
                "a parameter without a cast: {}",
                query.text
            );
            let highest = (1..=query.types.len() + 1)
                .rev()
                .find(|n| query.text.contains(&format!("${n}")))
                .unwrap_or(0);
            assert_eq!(highest, query.types.len(), "{}", query.text);
        }
    }
}
