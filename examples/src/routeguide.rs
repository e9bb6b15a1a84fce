//! The route guide service and client helpers, as in tonic's routeguide example.

use crate::pb::routeguide::route_guide_server::RouteGuide;
use crate::pb::routeguide::{Feature, Point, Rectangle, RouteNote, RouteSummary};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::{wrappers::ReceiverStream, Stream, StreamExt};
use tonic::{Request, Response, Status};

/// The route guide server.
#[derive(Debug)]
pub struct RouteGuideService {
    /// The features served.
    pub features: Arc<Vec<Feature>>,
}

#[tonic::async_trait]
impl RouteGuide for RouteGuideService {
    async fn get_feature(&self, request: Request<Point>) -> Result<Response<Feature>, Status> {
        tracing::debug!("GetFeature = {:?}", request.get_ref());

        for feature in &self.features[..] {
            if feature.location.as_ref() == Some(request.get_ref()) {
                return Ok(Response::new(feature.clone()));
            }
        }

        Ok(Response::new(Feature::default()))
    }

    type ListFeaturesStream = ReceiverStream<Result<Feature, Status>>;

    async fn list_features(
        &self,
        request: Request<Rectangle>,
    ) -> Result<Response<Self::ListFeaturesStream>, Status> {
        tracing::debug!("ListFeatures = {:?}", request.get_ref());

        let (tx, rx) = mpsc::channel(4);
        let features = self.features.clone();

        tokio::spawn(async move {
            for feature in &features[..] {
                if in_range(feature.location.as_ref().unwrap(), request.get_ref()) {
                    tx.send(Ok(feature.clone())).await.unwrap();
                }
            }

            tracing::debug!("ListFeatures: done sending");
        });

        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn record_route(
        &self,
        request: Request<tonic::Streaming<Point>>,
    ) -> Result<Response<RouteSummary>, Status> {
        tracing::debug!("RecordRoute");

        let mut stream = request.into_inner();

        let mut summary = RouteSummary::default();
        let mut last_point = None;
        let now = Instant::now();

        while let Some(point) = stream.next().await {
            let point = point?;

            // Increment the point count
            summary.point_count += 1;

            // Find features
            for feature in &self.features[..] {
                if feature.location.as_ref() == Some(&point) {
                    summary.feature_count += 1;
                }
            }

            // Calculate the distance
            if let Some(ref last_point) = last_point {
                summary.distance += calc_distance(last_point, &point);
            }

            last_point = Some(point);
        }

        summary.elapsed_time = now.elapsed().as_secs() as i32;

        Ok(Response::new(summary))
    }

    type RouteChatStream = Pin<Box<dyn Stream<Item = Result<RouteNote, Status>> + Send + 'static>>;

    async fn route_chat(
        &self,
        request: Request<tonic::Streaming<RouteNote>>,
    ) -> Result<Response<Self::RouteChatStream>, Status> {
        tracing::debug!("RouteChat");

        let mut notes = HashMap::new();
        let mut stream = request.into_inner();

        let output = async_stream(move |tx| async move {
            while let Some(note) = stream.next().await {
                let note = match note {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                let location = note.location.unwrap();
                let location_notes = notes.entry(location).or_insert(vec![]);
                location_notes.push(note);

                for note in location_notes {
                    if tx.send(Ok(note.clone())).await.is_err() {
                        return;
                    }
                }
            }
        });

        Ok(Response::new(Box::pin(output) as Self::RouteChatStream))
    }
}

/// A stream fed by a task (tonic's example uses `async_stream::try_stream!`).
fn async_stream<F, Fut>(f: F) -> ReceiverStream<Result<RouteNote, Status>>
where
    F: FnOnce(mpsc::Sender<Result<RouteNote, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(f(tx));
    ReceiverStream::new(rx)
}

/// Whether `point` lies in `rect`.
pub fn in_range(point: &Point, rect: &Rectangle) -> bool {
    use std::cmp;

    let lo = rect.lo.as_ref().unwrap();
    let hi = rect.hi.as_ref().unwrap();

    let left = cmp::min(lo.longitude, hi.longitude);
    let right = cmp::max(lo.longitude, hi.longitude);
    let top = cmp::max(lo.latitude, hi.latitude);
    let bottom = cmp::min(lo.latitude, hi.latitude);

    point.longitude >= left
        && point.longitude <= right
        && point.latitude >= bottom
        && point.latitude <= top
}

/// Calculates the distance between two points, in metres (haversine).
pub fn calc_distance(p1: &Point, p2: &Point) -> i32 {
    const CORD_FACTOR: f64 = 1e7;
    const R: f64 = 6_371_000.0; // meters

    let lat1 = p1.latitude as f64 / CORD_FACTOR;
    let lat2 = p2.latitude as f64 / CORD_FACTOR;
    let lng1 = p1.longitude as f64 / CORD_FACTOR;
    let lng2 = p2.longitude as f64 / CORD_FACTOR;

    let lat_rad1 = lat1.to_radians();
    let lat_rad2 = lat2.to_radians();

    let delta_lat = (lat2 - lat1).to_radians();
    let delta_lng = (lng2 - lng1).to_radians();

    let a = (delta_lat / 2f64).sin() * (delta_lat / 2f64).sin()
        + (lat_rad1).cos() * (lat_rad2).cos() * (delta_lng / 2f64).sin() * (delta_lng / 2f64).sin();

    let c = 2f64 * a.sqrt().atan2((1f64 - a).sqrt());

    (R * c) as i32
}

#[derive(Debug, serde::Deserialize)]
struct JsonFeature {
    location: JsonPoint,
    name: String,
}

#[derive(Debug, serde::Deserialize)]
struct JsonPoint {
    latitude: i32,
    longitude: i32,
}

/// The bundled feature database (`examples/data/route_guide_db.json`, same
/// format as gRPC's `route_guide_db.json`).
pub const BUNDLED_DB: &str = include_str!("../data/route_guide_db.json");

/// Parses a route guide database in the JSON format of gRPC's examples.
pub fn load_db(json: &str) -> Result<Vec<Feature>, serde_json::Error> {
    let decoded: Vec<JsonFeature> = serde_json::from_str(json)?;
    Ok(decoded
        .into_iter()
        .map(|f| Feature {
            name: f.name,
            location: Some(Point {
                longitude: f.location.longitude,
                latitude: f.location.latitude,
            }),
        })
        .collect())
}

/// The service with the bundled database.
pub fn service() -> RouteGuideService {
    RouteGuideService {
        features: Arc::new(load_db(BUNDLED_DB).expect("bundled route guide db is valid JSON")),
    }
}
