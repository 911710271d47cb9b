//! Routines: for a store behind a transaction pooler, each statement of a request's path as a
//! PL/pgSQL procedure of its own, so that the server no longer parses and plans it per call.
//!
//! Without prepared statements (`prepare_statements(false)`, see `typed`) the server parses and
//! plans every statement it is sent, which for the claim's and the completion's statements costs
//! more than executing them (BENCHMARKS.md, "PgStore through PgBouncer"). A PL/pgSQL routine keeps
//! the plans of its statements for the life of the server connection, which a pooler keeps open
//! across its clients' transactions, and holds nothing a client can see between transactions. So
//! the routine runs the very text the store would have sent, with the same `$n` parameters, as one
//! statement with a fresh snapshot, as before; its `INOUT` parameters carry the row back, and a
//! last one, `hit`, whether there was one. It is a procedure, not a function: a `CALL` is not
//! planned at all, where a `SELECT` of a function would be (measured with `pgbench`, same section).
//! Its arguments are bound parameters, not literals in the call's text: parsing literals cost the
//! server more than sending the call as one simple query would save (BENCHMARKS.md, "PgStore
//! through PgBouncer").
//!
//! A routine's name carries a hash of its parameter types and its text: a build whose
//! statement differs calls a routine of its own, and two builds can share a schema during a
//! rolling deploy. A store that migrates creates the routines it lacks, under the schema's
//! migration lock; one that does not (`migrate(false)`, the CLI) uses those it finds and
//! sends the rest as statements.

use std::collections::HashSet;

use ::postgres::Client;
use ::postgres::types::Type;

use super::migrations::lock_schema;
use super::rows::{col, pg};
use super::sql::Sql;
use super::typed::Query;
use crate::api::trace;
use crate::error::Result;

/// The common start of every routine's name.
const PREFIX: &str = "idempotency_q_";

/// Calls the routines of the statements of a request's path from now on, creating the ones
/// the schema lacks first if `create`.
pub(super) fn route(client: &mut Client, schema: &str, create: bool, sql: &mut Sql) -> Result<()> {
    const CONTEXT: &str = "installing the store's routines";
    let mut txn = client.transaction().map_err(|e| pg(CONTEXT, e))?;
    if create {
        lock_schema(&mut txn, schema).map_err(|e| pg(CONTEXT, e))?;
    }
    let present = existing(&mut txn, schema)?;
    let mut missing = Vec::new();
    for (label, query) in sql.routable_mut() {
        let name = name_of(label, query);
        if !create && !present.contains(&name) {
            missing.push(label);
            continue;
        }
        // The server says what the statement returns, which the routine declares and the
        // call passes placeholders for.
        let described = txn
            .prepare_typed(query.text(), query.types())
            .map_err(|e| pg(CONTEXT, e))?;
        let columns: Vec<&Type> = described.columns().iter().map(|c| c.type_()).collect();
        if columns.is_empty() {
            continue; // nothing to answer with; all of them return rows today
        }
        if !present.contains(&name) {
            txn.batch_execute(&definition(schema, &name, query, &columns))
                .map_err(|e| pg(CONTEXT, e))?;
        }
        query.route(call(schema, &name, query.types(), columns.len()));
    }
    txn.commit().map_err(|e| pg(CONTEXT, e))?;
    if !missing.is_empty() {
        trace::routines_missing(&missing.join(", "));
    }
    Ok(())
}

/// The names of the routines in `schema`.
fn existing(client: &mut impl ::postgres::GenericClient, schema: &str) -> Result<HashSet<String>> {
    let like = format!("{}%", PREFIX.replace('_', "\\_"));
    Query::new(
        "SELECT p.proname::text FROM pg_proc AS p JOIN pg_namespace AS n \
         ON n.oid = p.pronamespace WHERE n.nspname = $1::text AND p.proname LIKE $2::text"
            .to_owned(),
    )
    .query(client, &[&schema, &like])
    .map_err(|e| pg("reading the store's routines", e))?
    .iter()
    .map(|row| col(row, 0))
    .collect()
}

/// The shape of the routines [`definition`] writes, in their names' hash: a change of shape
/// must change this, so that no build calls a routine of another shape.
const SHAPE: &[u8] = b"procedure, INOUT outputs and hit, no defaults\n";

/// `idempotency_q_<label>_<hash>`: the hash of the routines' shape, the parameter types and
/// the text, so that another statement gets another routine.
fn name_of(label: &str, query: &Query) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(SHAPE);
    for ty in query.types() {
        hasher.update(ty.name().as_bytes());
        hasher.update(b",");
    }
    hasher.update(b"\n");
    hasher.update(query.text().as_bytes());
    let hash = hasher.finalize().to_hex();
    format!("{PREFIX}{label}_{}", &hash[..16])
}

/// The routine's call, with the statement's parameters cast as the routine declares them and
/// a NULL for each of its `INOUT` ones (`outputs`, and `hit`). Passed, not defaulted: the
/// server would read a default's expression from the catalog on every call.
fn call(schema: &str, name: &str, types: &[Type], outputs: usize) -> String {
    let args: Vec<String> = types
        .iter()
        .enumerate()
        .map(|(i, ty)| format!("${}::{}", i + 1, ty.name()))
        .chain(std::iter::repeat_n("NULL".to_owned(), outputs + 1))
        .collect();
    format!("CALL \"{schema}\".{name}({})", args.join(", "))
}

/// The procedure that runs `query`, which answers at most one row with `columns`' types.
/// `use_column`: a name in the statement is never read as one of the routine's parameters.
fn definition(schema: &str, name: &str, query: &Query, columns: &[&Type]) -> String {
    let mut params: Vec<String> = query
        .types()
        .iter()
        .map(|ty| ty.name().to_owned())
        .collect();
    let outputs: Vec<String> = (0..columns.len()).map(|i| format!("c{i}")).collect();
    for (output, ty) in outputs.iter().zip(columns) {
        params.push(format!("INOUT {output} {}", ty.name()));
    }
    params.push("INOUT hit boolean".to_owned());
    format!(
        "CREATE PROCEDURE \"{schema}\".{name}({}) LANGUAGE plpgsql AS $routine$ \
         #variable_conflict use_column\n\
         BEGIN {} INTO {}; hit := FOUND; END $routine$",
        params.join(", "),
        query.text(),
        outputs.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_differ_with_the_text_and_fit_an_identifier() {
        let a = Query::new("SELECT $1::bigint".to_owned());
        let b = Query::new("SELECT $1::bigint + 1".to_owned());
        assert_ne!(name_of("x", &a), name_of("x", &b));
        assert_eq!(name_of("x", &a), name_of("x", &a));
        for (label, query) in Sql::new("s", true, false).routable_mut() {
            assert!(name_of(label, query).len() <= 63, "{label}");
        }
    }

    #[test]
    fn a_call_passes_every_parameter_with_its_type() {
        assert_eq!(
            call("s", "f", &[Type::INT8, Type::TEXT, Type::BYTEA], 2),
            "CALL \"s\".f($1::int8, $2::text, $3::bytea, NULL, NULL, NULL)"
        );
    }
}
